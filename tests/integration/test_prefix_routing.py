"""Prefix-affine routing and SGLang's own accounting, end to end over real HTTP (issue 26): several simulator
replicas, whose radix caches answer meta_info.cached_tokens as SGLang's does (runner/sim/tokenmill_sim/radix.py,
capacity.py), the real runner, the committed rows and the report.

Concurrency 4 keeps every replica under smg's spill gate (load > mean + at least 4: `routing.py`), so each group's
requests all reach the replica that holds its prefix and the expected cache hits are exact."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from tokenmill_runner.generate.summary import EXIT_GIVEN_UP, EXIT_OK
from tokenmill_runner.report.files import REPORT_DIR, write_report
from tokenmill_runner.store.shards import read_committed_rows
from tokenmill_runner.store.storage import LocalStorage

from .test_exactly_once import run_cli
from .test_run import committed_errors
from .workloads import chat, spec_document, write_jsonl, write_spec

CONVERSATIONS = Path(__file__).resolve().parents[2] / "examples" / "prompts" / "conversations.jsonl"


def replicas(demo_model: Path, count: int, **config: Any) -> Iterator[list[str]]:
    from tokenmill_sim.config import SimConfig
    from tokenmill_sim.server import SimServer

    with ExitStack() as stack:
        yield [stack.enter_context(SimServer(SimConfig(model_path=str(demo_model), time_scale=5000.0,
                                                       max_running_requests=32, seed=i, **config))).url
               for i in range(count)]


@pytest.fixture
def three(demo_model: Path) -> Iterator[list[str]]:
    yield from replicas(demo_model, 3)


def server_args(urls: list[str]) -> list[str]:
    return [arg for url in urls[1:] for arg in ("--server", url)]


def run(tmp_path: Path, demo_model: Path, urls: list[str], dataset: dict[str, Any]) -> tuple[int, LocalStorage]:
    document = spec_document(demo_model, [dataset], "out",
                             runner={"concurrency": 4, "shardMaxSamples": 16, "shardMaxSeconds": 1, "maxAttempts": 3})
    spec = write_spec(tmp_path / "spec.yaml", document)
    done = run_cli(spec, tmp_path / "out", urls[0], None, *server_args(urls))
    assert done.returncode in (EXIT_OK, EXIT_GIVEN_UP), done.stderr[-3000:]
    return done.returncode, LocalStorage(tmp_path / "out")


def test_the_samples_of_a_prompt_find_it_cached_and_the_report_shows_the_share(tmp_path, demo_model, three):
    write_jsonl(tmp_path / "p.jsonl", [chat(i) for i in range(24)])
    code, storage = run(tmp_path, demo_model, three, {"name": "p", "source": "p.jsonl", "samples": 4})
    assert code == EXIT_OK
    rows = list(read_committed_rows(storage, "p"))
    assert len(rows) == 24 * 4
    by_line: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_line[row["line"]].append(row)
    for line, samples in by_line.items():
        # The first sample of the prompt to reach its replica prefills it; the three others find all of it but the
        # last token cached (SGLang matches input_len - 1 tokens), because they went to the same replica.
        full = [r for r in samples if r["cached_tokens"] == r["prompt_tokens"] - 1]
        assert len(full) >= 3, (line, [(r["cached_tokens"], r["prompt_tokens"]) for r in samples])
    report, _ = write_report(storage)
    cache = report["datasets"]["p"]["prefix_cache"]
    sent = sum(r["prompt_tokens"] for r in rows)
    assert cache["prompt_tokens_sent"] == sent and cache["cached_tokens"] == sum(r["cached_tokens"] for r in rows)
    assert cache["share"] >= 0.74  # 3 of 4 samples fully cached, plus the shared system prompt of the first ones
    assert "prefix-cache share" in storage.get(f"{REPORT_DIR}/report.md").decode()


def history_tokens(previous: dict[str, Any], turn: dict[str, Any]) -> int:
    """The most a turn can find cached: its prompt's common prefix with the previous turn's prompt and output, but
    never its last token (SGLang matches input_len - 1)."""
    held, prompt = previous["prompt_ids"] + previous["output_ids"], turn["prompt_ids"]
    common = next((i for i, (a, b) in enumerate(zip(held, prompt, strict=False)) if a != b), min(len(held), len(prompt)))
    return min(common, len(prompt) - 1)


def test_every_turn_of_a_conversation_finds_its_history_cached(tmp_path, demo_model):
    for urls in replicas(demo_model, 2):
        code, storage = run(tmp_path, demo_model, urls, {
            "name": "conv", "source": str(CONVERSATIONS), "limit": 12, "mode": "all-turns",
            "sampling": {"maxNewTokens": 10240}})
    assert code == EXIT_OK
    rows = list(read_committed_rows(storage, "conv"))
    later = 0
    for row in rows:
        turns = row["turns"]
        assert row["cached_tokens"] == sum(t["cached_tokens"] for t in turns)
        for previous, turn in zip(turns, turns[1:], strict=False):
            # SGLang caches a finished request's prompt and output; the next turn finds as much of its prompt as
            # extends them (the template drops the reasoning of earlier turns, so usually the previous prompt), on
            # the replica that served the conversation.
            assert turn["cached_tokens"] == history_tokens(previous, turn) > 0
            later += 1
    assert later >= 10
    report, _ = write_report(storage)
    cache = report["datasets"]["conv"]["prefix_cache"]
    assert cache["prompt_tokens_sent"] == sum(t["prompt_tokens"] for r in rows for t in r["turns"])


def test_sglangs_reasoning_count_is_recorded_next_to_tokenmills(tmp_path, demo_model, three):
    write_jsonl(tmp_path / "p.jsonl", [chat(i) for i in range(12)])
    code, storage = run(tmp_path, demo_model, three, {"name": "p", "source": "p.jsonl"})
    assert code == EXIT_OK
    rows = list(read_committed_rows(storage, "p"))
    reasoned = [r for r in rows if r["reasoning_end"] is not None]
    assert reasoned, "the demo model's outputs reason"
    for row in reasoned:  # require_reasoning was sent: SGLang counts through </think>
        assert row["server_reasoning_tokens"] == row["reasoning_end"] + 1 and row["reasoning_agrees"] is True
    report, _ = write_report(storage)
    assert report["datasets"]["p"]["reasoning_tokens_disagree"] == 0
    assert not [f for f in report["findings"] if f["check"] == "reasoning_tokens"]


def test_a_server_that_generates_from_other_ids_is_an_input_mismatch_and_fails_the_report(tmp_path, demo_model):
    write_jsonl(tmp_path / "p.jsonl", [chat(i) for i in range(6)])
    for urls in replicas(demo_model, 2, fault_input_mismatch_rate=1.0):
        code, storage = run(tmp_path, demo_model, urls, {"name": "p", "source": "p.jsonl"})
    assert code == EXIT_GIVEN_UP  # given up, not written off as the input's fault: --retry-failed runs them again
    assert not list(read_committed_rows(storage, "p"))
    errors = committed_errors(storage, "p")
    assert sorted(e["line"] for e in errors) == list(range(1, 7))
    assert {e["reason"] for e in errors} == {"input_mismatch"}
    assert "first difference at position" in errors[0]["message"]
    report, _ = write_report(storage)
    assert report["verdict"] == "fail"
    [finding] = [f for f in report["findings"] if f["check"] == "input_ids"]
    assert finding["level"] == "fail" and finding["value"] == 6


def test_a_release_that_does_not_echo_the_ids_is_not_asked_for_them(tmp_path, demo_model):
    """0.5.12.post1 has no return_prompt_token_ids (it arrived in 0.5.13.post1): nothing is compared, so even a
    faulty echo cannot fail the run; the rows record no reasoning count disagreement either."""
    write_jsonl(tmp_path / "p.jsonl", [chat(i) for i in range(6)])
    for urls in replicas(demo_model, 2, fault_input_mismatch_rate=1.0, sglang_version="0.5.12.post1"):
        code, storage = run(tmp_path, demo_model, urls, {"name": "p", "source": "p.jsonl"})
    assert code == EXIT_OK
    assert len(list(read_committed_rows(storage, "p"))) == 6


def test_the_groups_of_a_replica_killed_mid_run_move_and_keep_finding_their_prefix(tmp_path, demo_model):
    """One of three replicas dies with `samples: 4` in flight: nothing is lost or given up, its groups move to the
    live ones, where the samples still to come find the prefix again."""
    import asyncio

    from tokenmill_runner.prepare import prepare
    from tokenmill_runner.spec.config import RunnerConfig
    from tokenmill_runner.spec.resource import load_spec_file
    from tokenmill_sim.config import SimConfig
    from tokenmill_sim.server import SimServer

    from .sims import run_with_faults

    write_jsonl(tmp_path / "p.jsonl", [chat(i) for i in range(60)])
    spec = load_spec_file(write_spec(tmp_path / "spec.yaml", spec_document(
        demo_model, [{"name": "p", "source": "p.jsonl", "samples": 4}], "out", sampling={"maxNewTokens": 1024},
        runner={"concurrency": 12, "shardMaxSamples": 16, "shardMaxSeconds": 1}))).spec
    configs = [SimConfig(model_path=str(demo_model), time_scale=100.0, max_running_requests=16, seed=i)
               for i in range(3)]
    with SimServer(configs[0]) as doomed, SimServer(configs[1]) as one, SimServer(configs[2]) as two:
        config = RunnerConfig(spec=spec, servers=[doomed.url, one.url, two.url], output_uri=str(tmp_path / "out"),
                              probe_first_s=0.05, probe_max_s=0.2)

        async def go():
            runner = await prepare(config, api_key=None)
            return await run_with_faults(runner, [(80, lambda: asyncio.to_thread(doomed.kill))])

        summary = asyncio.run(go())
    assert summary.datasets[0].failed == {} and summary.datasets[0].generated == 240
    rows = list(read_committed_rows(LocalStorage(tmp_path / "out"), "p"))
    assert sorted((r["line"], r["sample_index"]) for r in rows) == [(line, i) for line in range(1, 61) for i in range(4)]
    late = [r for r in rows if r["line"] > 40]  # prompts read after the death: only live replicas served them
    full = sum(r["cached_tokens"] == r["prompt_tokens"] - 1 for r in late)
    assert full >= 3 * len(late) // 4 - 4, full
