"""n samples per prompt (issue 12): each slot (line, sample index) gets exactly one outcome and the same seed on
every run, whatever is killed when, and whatever `samples` becomes between runs; rows of other layouts (ShareGPT,
a Hugging Face folder of Parquet shards) run like chat rows."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenmill_runner.generate.seeds import SEED_RULE, sample_seed
from tokenmill_runner.generate.summary import EXIT_GIVEN_UP, EXIT_OK
from tokenmill_runner.store.markers import read_markers
from tokenmill_runner.store.shards import read_committed_rows
from tokenmill_runner.store.storage import LocalStorage

from .test_exactly_once import killed_at, run_cli
from .test_run import committed_errors
from .workloads import chat, spec_document, write_jsonl, write_spec

LINES = 80
BAD_LINE, DUPLICATE_LINE = 7, 50  # line 50 repeats line 3's sample id


@pytest.fixture
def sim(demo_model: Path):
    from tokenmill_sim.config import SimConfig
    from tokenmill_sim.server import SimServer

    with SimServer(SimConfig(model_path=str(demo_model), time_scale=5000.0, max_running_requests=32)) as server:
        yield server


def source(path: Path) -> Path:
    rows: list[object] = [chat(3 if line == DUPLICATE_LINE else line) for line in range(1, LINES + 1)]
    rows[BAD_LINE - 1] = b'{"sample_id": "broken", "messages": ['
    return write_jsonl(path, rows)


def spec(tmp_path: Path, demo_model: Path, samples: int, name: str = "it", out: str = "out", **dataset) -> Path:
    document = spec_document(demo_model, [{"name": "p", "source": "p.jsonl", "samples": samples, **dataset}], out,
                             runner={"concurrency": 16, "shardMaxSamples": 20, "shardMaxSeconds": 30})
    document["metadata"]["name"] = name
    return write_spec(tmp_path / f"{name}-{samples}.yaml", document)


def outcomes_per_slot(storage: LocalStorage) -> Counter[tuple[int, int]]:
    slots: Counter[tuple[int, int]] = Counter()
    for marker in read_markers(storage, "p"):
        for table in ("samples", "failed"):
            slots.update(zip(marker[table]["line"], marker[table]["sample_index"], strict=True))
    return slots


def test_a_killed_run_with_4_samples_resumes_with_the_same_seeds_and_nothing_twice(tmp_path, demo_model, sim):
    source(tmp_path / "p.jsonl")
    document = spec(tmp_path, demo_model, samples=4)
    out = tmp_path / "out"
    storage = LocalStorage(out)
    # Killed after the 3rd commit marker, and again in the middle of a later commit (data written, marker not).
    killed_at(run_cli(document, out, sim.url, "kill-after:marker:3"), "kill-after:marker:3")
    first_rows = {(r["line"], r["sample_index"]): r["seed"] for r in read_committed_rows(storage, "p")}
    assert 0 < len(first_rows) < (LINES - 2) * 4
    killed_at(run_cli(document, out, sim.url, "kill-after:data:2"), "kill-after:data:2")
    done = run_cli(document, out, sim.url)
    assert done.returncode == EXIT_OK, done.stderr[-2000:]

    every_slot = {(line, index) for line in range(1, LINES + 1) for index in range(4)}
    assert outcomes_per_slot(storage) == Counter(every_slot), "every slot settled exactly once"
    rows = list(read_committed_rows(storage, "p"))
    seeds = {(r["line"], r["sample_index"]): r["seed"] for r in rows}
    assert len(seeds) == len(rows) == (LINES - 2) * 4
    assert all(seeds[slot] == seed for slot, seed in first_rows.items()), "the first run's seeds are the rule's"
    assert seeds == {slot: sample_seed(None, "p", *slot) for slot in seeds}
    assert all(len({seeds[(line, i)] for i in range(4)}) == 4 for line, _ in seeds)
    # The simulator draws from the seed (as SGLang with --enable-deterministic-inference): 4 different answers.
    outputs: dict[int, set[tuple[int, ...]]] = {}
    for row in rows:
        outputs.setdefault(row["line"], set()).add(tuple(row["output_ids"]))
    assert sum(len(o) == 4 for o in outputs.values()) >= 0.9 * len(outputs)
    errors = Counter((e["line"], e["reason"]) for e in committed_errors(storage, "p"))
    assert errors == Counter({(BAD_LINE, "invalid_json"): 4, (DUPLICATE_LINE, "duplicate_sample_id"): 4})
    run = orjson.loads(storage.get("run.json"))
    assert run["seeds"] == {"base": 0, "rule": SEED_RULE, "sent_as_sampling_seed": True,
                            "deterministic_inference": False}
    assert run["datasets"]["p"]["samples"] == 4
    # The report checks completeness against slots (rows x samples), not rows.
    report = orjson.loads(storage.get("report/report.json"))["datasets"]["p"]
    assert (report["slots"], report["without_outcome"]) == (LINES * 4, 0)


def test_the_same_spec_gives_the_same_seeds_under_another_name(tmp_path, demo_model, sim):
    source(tmp_path / "p.jsonl")
    seeds = []
    for name in ("first", "second"):
        out = tmp_path / name
        assert run_cli(spec(tmp_path, demo_model, 2, name=name, out=name, limit=10), out, sim.url).returncode == 0
        seeds.append({(r["line"], r["sample_index"]): (r["seed"], tuple(r["output_ids"]))
                      for r in read_committed_rows(LocalStorage(out), "p")})
    assert seeds[0] == seeds[1] and len(seeds[0]) == 9 * 2  # lines 1-10 but the bad line 7


def test_raising_samples_generates_only_the_new_slots_and_lowering_keeps_the_extra(tmp_path, demo_model, sim):
    source(tmp_path / "p.jsonl")
    out = tmp_path / "out"
    storage = LocalStorage(out)
    assert run_cli(spec(tmp_path, demo_model, 2, limit=20), out, sim.url).returncode == EXIT_OK
    before = {(r["line"], r["sample_index"]): r["output_ids"] for r in read_committed_rows(storage, "p")}
    done = run_cli(spec(tmp_path, demo_model, 3, limit=20), out, sim.url)
    assert done.returncode == EXIT_OK, done.stderr[-2000:]
    assert outcomes_per_slot(storage) == Counter({(line, i) for line in range(1, 21) for i in range(3)})
    after = {(r["line"], r["sample_index"]): r["output_ids"] for r in read_committed_rows(storage, "p")}
    assert {slot: ids for slot, ids in after.items() if slot[1] < 2} == before, "earlier samples untouched"
    markers = len(list(read_markers(storage, "p")))
    lowered = run_cli(spec(tmp_path, demo_model, 1, limit=20), out, sim.url, None)
    assert lowered.returncode == EXIT_OK, lowered.stderr[-2000:]
    assert len(list(read_markers(storage, "p"))) == markers, "nothing generated: every sample 0 is settled"
    assert "38 rows of sample indices 1 and up were committed by a run with more samples" in lowered.stderr
    assert outcomes_per_slot(storage) == Counter({(line, i) for line in range(1, 21) for i in range(3)})


def test_a_sharegpt_dataset_folder_of_parquet_shards_runs_with_lines_across_shards(tmp_path, demo_model, sim):
    # Hugging Face layout: data/train-0000k-of-00002.parquet; line numbers continue from shard to shard.
    (tmp_path / "hf" / "data").mkdir(parents=True)
    turns = [[{"from": "human", "value": f"Question {i}: name a prime above {i}."}] for i in range(1, 13)]
    turns[8] = [{"from": "narrator", "value": "x"}]  # line 9, the 3rd row of the second shard
    for shard, part in enumerate((turns[:6], turns[6:])):
        table = pa.table({"uid": [f"q{6 * shard + i + 1}" for i in range(len(part))], "conversations": part})
        pq.write_table(table, tmp_path / "hf" / "data" / f"train-0000{shard}-of-00002.parquet")
    document = spec_document(demo_model, [{"name": "p", "source": "hf", "samples": 2,
                                           "input": {"format": "sharegpt", "fields": {"id": "uid"}}}], "out")
    path = write_spec(tmp_path / "hf.yaml", document)
    out = tmp_path / "out"
    done = run_cli(path, out, sim.url)
    assert done.returncode == EXIT_OK, done.stderr[-2000:]
    storage = LocalStorage(out)
    rows = list(read_committed_rows(storage, "p"))
    assert sorted({(r["line"], r["sample_id"]) for r in rows}) == [(i, f"q{i}") for i in range(1, 13) if i != 9]
    [error] = {(e["line"], e["reason"], e["message"]) for e in committed_errors(storage, "p")}
    assert error[:2] == (9, "unknown_role")
    assert "conversations[0].from is 'narrator'" in error[2] and "shard data/train-00001-of-00002.parquet, row 3" \
        in error[2]


def test_retry_failed_runs_again_only_the_given_up_samples_of_a_prompt(tmp_path, demo_model, sim):
    from tokenmill_sim.config import SimConfig
    from tokenmill_sim.server import SimServer

    write_jsonl(tmp_path / "p.jsonl", [chat(line) for line in range(1, 21)])
    document = spec_document(demo_model, [{"name": "p", "source": "p.jsonl", "samples": 3}], "out",
                             runner={"concurrency": 8, "maxAttempts": 1, "shardMaxSamples": 10, "shardMaxSeconds": 1})
    path = write_spec(tmp_path / "retry.yaml", document)
    out = tmp_path / "out"
    storage = LocalStorage(out)
    # Faults are drawn per request (tokenmill_sim/server.py: one stream, not per prompt): some samples of a prompt
    # fail while its others succeed.
    with SimServer(SimConfig(model_path=str(demo_model), time_scale=5000.0, fault_abort_rate=0.4)) as flaky:
        gave_up = run_cli(path, out, flaky.url)
    assert gave_up.returncode == EXIT_GIVEN_UP, gave_up.stderr[-2000:]
    first = {(r["line"], r["sample_index"]): r["output_ids"] for r in read_committed_rows(storage, "p")}
    failed = {(e["line"], e["sample_index"]) for e in committed_errors(storage, "p")}
    assert first and failed and not set(first) & failed
    assert any((line, i) in failed and (line, j) in first for line in range(1, 21) for i in range(3) for j in range(3))

    # A first retry round on the same flaky server: some given-up slots fail again, now in round 1.
    with SimServer(SimConfig(model_path=str(demo_model), time_scale=5000.0, fault_abort_rate=0.4)) as flaky:
        again = run_cli(path, out, flaky.url, None, "--retry-failed")
    assert again.returncode == EXIT_GIVEN_UP, again.stderr[-2000:]
    round_one = {(r["line"], r["sample_index"]) for r in read_committed_rows(storage, "p")} - set(first)
    failed_twice = failed - round_one
    assert round_one and failed_twice
    in_round = {(e["line"], e["sample_index"]): e["retry_round"] for e in committed_errors(storage, "p")
                if "retry_round" in e}
    assert in_round == dict.fromkeys(failed_twice, 1), "a failure in a retry round records its round"

    retried = run_cli(path, out, sim.url, None, "--retry-failed")
    assert retried.returncode == EXIT_OK, retried.stderr[-2000:]
    rows = {(r["line"], r["sample_index"]): r for r in read_committed_rows(storage, "p")}
    assert set(rows) == {(line, i) for line in range(1, 21) for i in range(3)}
    assert len(list(read_committed_rows(storage, "p"))) == 60, "no slot has two rows"
    assert all(rows[slot]["output_ids"] == ids for slot, ids in first.items()), "settled samples were not rerun"
    # Settled slots keep their seed; a given-up slot is run again one round past the last it failed in, with seeds
    # no earlier round drew (under deterministic inference an earlier round's seed would replay the draw that failed).
    assert all(rows[slot]["seed"] == sample_seed(None, "p", *slot) for slot in first)
    assert all(rows[slot]["seed"] == sample_seed(None, "p", *slot, attempt=rows[slot]["attempts"] - 1, retry_round=1)
               for slot in round_one)
    assert all(rows[slot]["seed"] == sample_seed(None, "p", *slot, attempt=rows[slot]["attempts"] - 1, retry_round=2)
               for slot in failed_twice)


def test_a_dataset_folder_on_s3_is_found_read_in_order_and_identified_by_its_shards(s3_endpoint, s3_bucket):
    import io

    from tokenmill_runner.source.reader import read_prompts, source_format, source_identity
    from tokenmill_runner.store.storage import s3_client

    client = s3_client(s3_endpoint)

    def put_shard(key: str, prompts: list[str]) -> None:
        buffer = io.BytesIO()
        pq.write_table(pa.table({"prompt": prompts}), buffer)
        client.put_object(Bucket=s3_bucket, Key=key, Body=buffer.getvalue())

    put_shard("hf/data/train-00001-of-00002.parquet", ["c", "d"])
    put_shard("hf/data/train-00000-of-00002.parquet", ["a", "b"])
    client.put_object(Bucket=s3_bucket, Key="hf/README.md", Body=b"# a dataset card")
    for source in (f"s3://{s3_bucket}/hf/", f"s3://{s3_bucket}/hf"):
        assert source_format(source, "auto", s3_endpoint) == "parquet"
        got = [(p.line, p.messages[0]["content"]) for p in read_prompts(source, "parquet", s3_endpoint)]
        assert got == [(1, "a"), (2, "b"), (3, "c"), (4, "d")]
    before = source_identity(f"s3://{s3_bucket}/hf/", s3_endpoint)
    put_shard("hf/data/train-00001-of-00002.parquet", ["c", "d", "e"])
    assert source_identity(f"s3://{s3_bucket}/hf/", s3_endpoint) != before
