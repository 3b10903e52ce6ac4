"""A measured trial's candidate over real HTTP: a runner started with --trial-sample sends its candidate's stratified
sample of every dataset first, in the sample's order, then the rest of the job; the next candidate's runner, on the
same output after the first was stopped, sends its own (disjoint) sample first; every slot is committed once.

The order is what the server receives: a proxy in front of the simulator records each /generate body's input_ids,
which the committed rows' prompt_ids map back to (dataset, line)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import numpy as np

from tokenmill_runner.generate.pipeline import Runner
from tokenmill_runner.prepare import prepare
from tokenmill_runner.source.stratified import SourceRows, first_lines
from tokenmill_runner.spec.config import RunnerConfig, TrialSample
from tokenmill_runner.spec.resource import load_spec_file
from tokenmill_runner.store.shards import read_committed_rows
from tokenmill_runner.store.storage import open_storage

from .test_run import assert_exactly_once
from .workloads import chat, spec_document, write_jsonl, write_spec

LONG, SHORT = 40, 15  # rows; the long dataset has a blank line 21, so its rows are on lines 1-20 and 22-41
SEED, CANDIDATES, PROMPTS = "9", 3, 9
OUTPUT_TOKENS = {"long": 60.0, "short": 30.0}


class Recorder:
    """Forwards every request to the simulator; records the input_ids of each /generate in arrival order and calls
    `after(n)` once the n-th has arrived."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.sent: list[tuple[int, ...]] = []
        self.lock = threading.Lock()
        self.after: Callable[[int], None] = lambda n: None

    def __enter__(self) -> Recorder:
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if method == "POST" and self.path.startswith("/generate"):
                    with recorder.lock:
                        recorder.sent.append(tuple(json.loads(body)["input_ids"]))
                        count = len(recorder.sent)
                    recorder.after(count)
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")}
                answer = httpx.request(method, recorder.target + self.path, content=body or None, headers=headers,
                                       timeout=60)
                try:
                    self.send_response(answer.status_code)
                    self.send_header("Content-Type", answer.headers.get("content-type", "application/json"))
                    self.send_header("Content-Length", str(len(answer.content)))
                    self.end_headers()
                    self.wfile.write(answer.content)
                except BrokenPipeError:  # the stopped runner's request: it is sent again by the next one
                    pass

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                self._forward("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._forward("POST")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def sample(candidate: int) -> list[tuple[str, int]]:
    """The candidate's rows in the sample's order, from the pure rule (tests/unit/test_trial_sample.py)."""
    skipped = np.zeros(LONG + 1, dtype=bool)
    skipped[20] = True
    lines = first_lines(SEED, candidate, CANDIDATES, PROMPTS, OUTPUT_TOKENS,
                        [SourceRows("long", LONG, skipped), SourceRows("short", SHORT)])
    return sorted(((name, line) for name, found in lines.items() for line in found),
                  key=lambda row: lines[row[0]][row[1]])


async def run_candidate(spec_path, recorder: Recorder, out: str, candidate: int, stop_after: int | None) -> None:
    spec = load_spec_file(spec_path).spec
    config = RunnerConfig(spec=spec, servers=[recorder.url], output_uri=out, trial_sample=TrialSample(
        seed=SEED, candidate=candidate, candidates=CANDIDATES, prompts=PROMPTS, output_tokens=OUTPUT_TOKENS))
    runner: Runner = await prepare(config, api_key=None)
    loop = asyncio.get_running_loop()
    if stop_after is not None:
        # The trial's switch: the operator deletes this candidate's Job (SIGTERM) once its minutes are measured.
        recorder.after = lambda n: loop.call_soon_threadsafe(runner.request_stop) if n == stop_after else None
    await runner.run()
    recorder.after = lambda n: None


def test_each_candidate_sends_its_own_stratified_sample_first_and_every_slot_is_committed_once(
        tmp_path, simulator, demo_model):
    long_rows = [chat(i) for i in range(LONG)]
    write_jsonl(tmp_path / "long.jsonl", [*long_rows[:20], b"", *long_rows[20:]])
    write_jsonl(tmp_path / "short.jsonl", [chat(100 + i) for i in range(SHORT)])
    # One request in flight: the order the server receives is the order the runner sends.
    spec = write_spec(tmp_path / "spec.yaml", spec_document(
        demo_model, [{"name": "long", "source": "long.jsonl"}, {"name": "short", "source": "short.jsonl"}], "out",
        runner={"concurrency": 1, "shardMaxSamples": 2, "shardMaxSeconds": 1, "maxAttempts": 8},
        sampling={"maxNewTokens": 32}))
    out = str(tmp_path / "out")
    first, second = sample(0), sample(1)
    assert {name for name, _ in first} == {"long", "short"} and not set(first) & set(second)
    with Recorder(simulator.url) as recorder:
        # Candidate 1's Job, stopped a few requests past its sample; then candidate 2's, to the end.
        asyncio.run(run_candidate(spec, recorder, out, 0, stop_after=len(first) + 3))
        sent_first = len(recorder.sent)
        asyncio.run(run_candidate(spec, recorder, out, 1, stop_after=None))
    storage = open_storage(out)
    rows = {name: assert_exactly_once(storage, name, {r["sample_id"] for r in read_committed_rows(storage, name)})
            for name in ("long", "short")}
    assert len(rows["long"]) == LONG and len(rows["short"]) == SHORT
    where = {tuple(r["prompt_ids"]): (name, r["line"]) for name, found in rows.items() for r in found}
    order = [where[ids] for ids in recorder.sent if ids in where]
    assert order[:len(first)] == first, (order[:len(first)], first)
    # The stopped Job's last request was in flight: the next Job sends it again. Past its sample the first Job
    # went on in the job's own order; what it finished there is not sent again, even where the next sample has it.
    done = set(order[:sent_first - 1])
    later = [row for row in order[sent_first:] if row not in done]
    assert len(later) == len(order) - sent_first
    own = [row for row in second if row not in done]
    assert len(own) >= len(second) - 3 and later[:len(own)] == own, (later[:len(own)], own)
    # After its sample, each Job goes on with the job's own order: the long dataset's rows, then the short one's.
    rest = later[len(second):]
    assert rest and rest == sorted(rest, key=lambda row: row[0] != "long")
    assert 21 not in {line for name, line in order if name == "long"}  # the blank line is no row
