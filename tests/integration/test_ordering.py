"""Longest-expected-first over real HTTP: a worker sends the rows whose earlier answers are longest first, and
every slot is still committed exactly once, on the first run and on a second that finds everything done."""

from __future__ import annotations

import asyncio

from tokenmill_runner.store.markers import read_markers
from tokenmill_runner.store.storage import open_storage

from .test_run import assert_exactly_once, run_spec
from .workloads import chat, spec_document, write_jsonl, write_spec


def regenerated(i: int, answer_words: int) -> dict:
    row = chat(i)
    row["messages"].append({"role": "assistant", "content": " ".join(["word"] * answer_words)})
    return row


def test_rows_with_the_longest_earlier_answers_are_sent_first(tmp_path, simulator, demo_model):
    # Source order: shortest earlier answer first; rows 20-23 carry no answer and fall back to their prompt's class.
    rows = [regenerated(i, 10 * (i + 1)) for i in range(20)] + [chat(i) for i in range(20, 24)]
    write_jsonl(tmp_path / "regen.jsonl", rows)
    # One request in flight at a time and one sample per shard: the shards' sequence numbers are the send order.
    spec = write_spec(tmp_path / "spec.yaml", spec_document(
        demo_model, [{"name": "regen", "source": "regen.jsonl", "mode": "all-turns"}], "out",
        runner={"concurrency": 1, "shardMaxSamples": 1, "shardMaxSeconds": 2, "maxAttempts": 8},
        sampling={"maxNewTokens": 64}))
    asyncio.run(run_spec(spec, [simulator.url], str(tmp_path / "out")))
    storage = open_storage(str(tmp_path / "out"))
    ids = {row["sample_id"] for row in rows}
    assert_exactly_once(storage, "regen", ids)
    markers = sorted(read_markers(storage, "regen"), key=lambda marker: int(marker["shard_id"].rsplit("-", 1)[1]))
    order = [sample for marker in markers for sample in marker["samples"]["sample_id"]]
    # The window (16 requests at concurrency 1) holds rows 0-15 and lets each longer arrival (16-19) through,
    # then releases what it holds longest first as the rows without an answer arrive; those come last.
    assert order == [f"s{i:04d}" for i in [*range(16, 20), *range(15, -1, -1), *range(20, 24)]]
    # A second run finds every slot settled and sends nothing.
    summary = asyncio.run(run_spec(spec, [simulator.url], str(tmp_path / "out")))
    assert summary.datasets[0].generated == 0 and summary.datasets[0].skipped == len(rows)
    assert_exactly_once(storage, "regen", ids)
