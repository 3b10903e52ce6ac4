"""Longest-expected-first over real HTTP: a worker sends the rows whose earlier answers are longest first, over the
whole job, and every slot is still committed exactly once, on the first run and on a second that finds everything
done."""

from __future__ import annotations

import asyncio
import random

from tokenmill_runner.store.markers import read_markers
from tokenmill_runner.store.storage import open_storage

from .test_run import assert_exactly_once, run_spec
from .workloads import chat, spec_document, write_jsonl, write_spec


def regenerated(i: int, answer_words: int) -> dict:
    row = chat(i)
    row["messages"].append({"role": "assistant", "content": " ".join(["word"] * answer_words)})
    return row


def send_order(tmp_path, simulator, demo_model, rows: list[dict]) -> tuple[list[int], object]:
    """Regenerate `rows` (mode all-turns) one request at a time, one sample per shard: the shards' sequence
    numbers are the send order. Every slot is committed exactly once; the lines in the order sent, and the store."""
    write_jsonl(tmp_path / "regen.jsonl", rows)
    spec = write_spec(tmp_path / "spec.yaml", spec_document(
        demo_model, [{"name": "regen", "source": "regen.jsonl", "mode": "all-turns"}], "out",
        runner={"concurrency": 1, "shardMaxSamples": 1, "shardMaxSeconds": 2, "maxAttempts": 8},
        sampling={"maxNewTokens": 64}))
    asyncio.run(run_spec(spec, [simulator.url], str(tmp_path / "out")))
    storage = open_storage(str(tmp_path / "out"))
    assert_exactly_once(storage, "regen", {row["sample_id"] for row in rows})
    markers = sorted(read_markers(storage, "regen"), key=lambda marker: int(marker["shard_id"].rsplit("-", 1)[1]))
    return [line for marker in markers for line in marker["samples"]["line"]], spec


def test_rows_with_the_longest_earlier_answers_are_sent_first_over_the_whole_job(tmp_path, simulator, demo_model):
    # Source order: 24 rows with short earlier answers, then 16 with long ones (longer and longer), then 4 without
    # an answer. The job (44 requests) is larger than the window (16 at concurrency 1): before issue 44 the window
    # filled with short rows and sent 8 of them first. Now the counting pass's length codes put the long rows in a
    # pass of their own, read first.
    rows = ([regenerated(i, 10) for i in range(24)] + [regenerated(i, 400 + 10 * i) for i in range(24, 40)]
            + [chat(i) for i in range(40, 44)])
    lines, spec = send_order(tmp_path, simulator, demo_model, rows)
    # The long rows first (each expected at the 64-token cap: ties keep the source's order); then the short ones,
    # all alike; then the rows without an answer (the dataset's typical length, 15 % of its cap, under the short
    # answers' ~12 tokens).
    assert lines == [i + 1 for i in [*range(24, 40), *range(24), *range(40, 44)]]
    # A second run finds every slot settled and sends nothing.
    summary = asyncio.run(run_spec(spec, [simulator.url], str(tmp_path / "out")))
    assert summary.datasets[0].generated == 0 and summary.datasets[0].skipped == len(rows)


def test_a_key_that_does_not_predict_the_lengths_sends_the_rest_in_input_order(tmp_path, simulator, demo_model):
    # Earlier answers of random lengths: the simulator's new ones do not follow them, so once the probe (the first 64
    # lines, sent as they come) is back, the order is turned off: the window releases what it holds in arrival
    # order, and one pass reads every line not read yet, in input order.
    rng = random.Random(44)
    lines, _ = send_order(tmp_path, simulator, demo_model, [regenerated(i, rng.choice([5, 40, 300])) for i in range(300)])
    assert lines[:64] == list(range(1, 65)), "the probe: the first lines as they come"
    # While the verdict is out the passes read a row at a time (a concurrency's worth) and the window (16 at
    # concurrency 1) holds the longest; once it is in, the window lets them out as they came, then every line not
    # read yet follows in input order.
    tail = lines[64 + 2 + 16:]
    assert tail == sorted(tail) and len(tail) > 200
