#!/usr/bin/env python3
"""The runner against a bare aiohttp client posting the identical bodies, side by side in one run. Not a test.

One simulator process at a high time scale, so the engine is never what limits the rate (its CPU is not counted;
it shares the machine with the client being measured, as a server would not). Passes alternate, the order flipped
every repetition, each in its own process:
- tokenmill: the runner (`prepare` + `Runner.run`: read, render, tokenize, /generate, Parquet shards, commit
  markers, progress), every request body it sends kept;
- bare: aiohttp with `concurrency` requests in flight posting exactly those bytes and parsing every answer with
  orjson (kept in memory; nothing written), the fastest plain client there is for this.
Reported per pass: CPU per sample (the process's CPU around the work, start-up apart; and the part of it on the
event loop's thread, which bounds one worker's rate), samples/s (wall), the simulator's CPU per sample, and the
paired ratios tokenmill / bare. Goals (issue 44): CPU <= x1.5, samples/s >= the bare client's.

Then `--together` repetitions run both clients at once, each against a simulator of its own (swapped every
repetition), the bare client posting its bodies over and over for exactly as long as tokenmill's run lasts. This
machine's speed drifts (a fixed Python loop's CPU time moves x1.2-x1.9 within a minute here), and passes in turn
pair two moments of it; passes at once share every moment, so their CPU ratio is the steadier measure. Their
samples/s are not the goal's (four processes share two cores).

    .venv/bin/python hack/bench/bench_runner.py [--samples 20000] [--samples-per-prompt 1] [--concurrency 256]
                                                [--reps 3] [--together 3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests
import yaml

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "examples" / "demo-model"
sys.path.insert(0, str(REPO / "runner"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_simulator(max_running: int, time_scale: float, profile: str | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "tokenmill_runner.cli", "-q", "sim-server", "--model-path", str(MODEL),
               "--port", str(port), "--time-scale", str(time_scale), "--max-running-requests", str(max_running)]
    if profile:
        command += ["--profile", profile]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if requests.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except requests.ConnectionError:
            pass
        time.sleep(0.1)
    raise SystemExit("the simulator did not start")


def write_workload(folder: Path, samples: int, max_new_tokens: int, per_prompt: int = 1) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    prompts = folder / "prompts.jsonl"
    with prompts.open("w") as handle:
        for i in range(samples):
            row = {"sample_id": f"b{i}", "messages": [
                {"role": "system", "content": "You are a careful assistant."},
                {"role": "user", "content": f"Question {i}: explain step by step why {i} * {i + 7} is what it is."}]}
            handle.write(json.dumps(row) + "\n")
    spec = {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "bench"},
            "spec": {"model": {"path": str(MODEL)}, "sampling": {"maxNewTokens": max_new_tokens},
                     "datasets": [{"name": "bench", "source": str(prompts), "samples": per_prompt}],
                     "runner": {"shardMaxSamples": 256, "shardMaxSeconds": 30},
                     "output": {"uri": str(folder / "out")}}}
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


# --- the children -------------------------------------------------------------------------------------------------

def child_tokenmill(spec_path: str, url: str, concurrency: int, bodies_out: str,
                    window: str | None = None) -> dict[str, Any]:
    """`window`: a folder where the run's start (`go`) and end (`stop`) are marked for a bare client running at
    the same time."""
    from tokenmill_runner.generate.client import GenerateClient
    from tokenmill_runner.prepare import prepare
    from tokenmill_runner.spec.config import RunnerConfig
    from tokenmill_runner.spec.resource import load_spec_file
    from tokenmill_runner.store.shards import encode_rows

    # pyarrow imports pandas on its first array where pandas is installed (this venv; not the runner's image): ~1 s
    # of CPU once per process, paid here, before the clock starts.
    encode_rows([{"sample_id": "warm-up", "prompt_ids": [1], "output_ids": [2]}])
    sent: list[bytes] = []
    encode = GenerateClient.encode_body

    def keeping(self: GenerateClient, *args: Any, **kwargs: Any) -> bytes:
        body = encode(self, *args, **kwargs)
        sent.append(body)
        return body

    GenerateClient.encode_body = keeping  # type: ignore[method-assign]
    resource = load_spec_file(Path(spec_path))
    spec = resource.spec.model_copy(update={"runner": resource.spec.runner.model_copy(
        update={"concurrency": concurrency})})
    config = RunnerConfig(spec=spec, servers=[url], output_uri=spec.output.uri, progress_log_s=3600)

    from tokenmill_runner.cli import _loop_factory, stream_settings

    async def go() -> dict[str, Any]:
        runner = await prepare(config, api_key=None)
        if window:
            (Path(window) / "go").touch()
        wall, cpu, loop_cpu = time.perf_counter(), time.process_time(), time.thread_time()
        with stream_settings():  # as `tokenmill run` does
            summary = await runner.run()
        result = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                  "loop_cpu_s": time.thread_time() - loop_cpu, "samples": summary.datasets[0].generated}
        if window:
            (Path(window) / "stop").touch()
        return result

    with asyncio.Runner(loop_factory=_loop_factory()) as loop:  # the loop `tokenmill run` runs on
        result = loop.run(go())
    Path(bodies_out).write_bytes(b"\n".join(sent))
    return result


def child_bare(url: str, bodies_path: str, concurrency: int, loop_name: str,
               window: str | None = None) -> dict[str, Any]:
    """Every body posted once; with a `window` (see child_tokenmill), the bodies over and over from its `go` to its
    `stop`, each request in flight at `stop` finished and counted."""
    import aiohttp
    import orjson

    bodies = Path(bodies_path).read_bytes().split(b"\n")

    async def marked(name: str) -> None:
        assert window is not None
        while not (Path(window) / name).exists():
            await asyncio.sleep(0.02)

    async def go() -> dict[str, Any]:
        answers: list[Any] = []
        queue = iter(bodies) if window is None else itertools.cycle(bodies)
        connector = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(connector=connector, headers={"Content-Type": "application/json"},
                                         timeout=aiohttp.ClientTimeout(total=3600)) as session:
            stopped = False

            async def worker() -> None:
                for body in queue:
                    if stopped:
                        return
                    async with session.post(f"{url}/generate", data=body) as response:
                        answers.append(orjson.loads(await response.read()))

            async def stop() -> None:
                nonlocal stopped
                await marked("stop")
                stopped = True

            if window is not None:
                await marked("go")
            wall, cpu, loop_cpu = time.perf_counter(), time.process_time(), time.thread_time()
            await asyncio.gather(*(worker() for _ in range(concurrency)), *([stop()] if window else []))
            result = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                      "loop_cpu_s": time.thread_time() - loop_cpu}
        assert (window is not None or len(answers) == len(bodies)) and all("output_ids" in a for a in answers)
        return {**result, "samples": len(answers)}

    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop if loop_name == "uvloop" else None) as loop:
        return loop.run(go())


def process_cpu_s(pid: int) -> float:
    """A running process's CPU so far (user + system, /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Child:
    """A child pass in its own process, and the simulator's CPU while it runs (the simulator shares the two cores:
    the rate a client reaches is bounded by the client's and the server's CPU per sample together)."""

    def __init__(self, simulator: int, *args: str) -> None:
        self.simulator, self.kind = simulator, args[0]
        self.out = tempfile.TemporaryFile()
        self.served = process_cpu_s(simulator)
        self.process = subprocess.Popen([sys.executable, __file__, "child", *args], stdout=self.out)

    def result(self) -> dict[str, Any]:
        """Its answer, plus its whole process's CPU (start-up included) and peak RSS from wait4."""
        _, status, usage = os.wait4(self.process.pid, 0)
        served = process_cpu_s(self.simulator) - self.served
        with self.out:
            self.out.seek(0)
            text = self.out.read().decode()
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"child {self.kind} failed: {text[-2000:]}")
        return {**json.loads(text.strip().splitlines()[-1]), "process_cpu_s": usage.ru_utime + usage.ru_stime,
                "peak_rss_mib": usage.ru_maxrss / 1024, "simulator_cpu_s": served}


def run_child(simulator: int, *args: str) -> dict[str, Any]:
    return Child(simulator, *args).result()


# --- the parent ---------------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 20,000: a pass long enough (~15 s) that the rate is the sustained one. The runner pays ~0.3-0.6 s once a run
    # (its first render batch, the last shard's commit, the summary) that the bare client, posting ready bodies and
    # writing nothing, does not: at 3,000 samples (~2 s) that alone read as x0.7-0.8 of the bare client's rate.
    parser.add_argument("--samples", type=int, default=20000, help="samples in all (prompts x samples per prompt)")
    parser.add_argument("--samples-per-prompt", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--time-scale", type=float, default=20000.0)
    parser.add_argument("--profile", default=None, help="the simulator's length profile (default: its own)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--together", type=int, default=3,
                        help="repetitions with both clients at once, each on a simulator of its own")
    parser.add_argument("--bare-loop", choices=("asyncio", "uvloop"), default="asyncio",
                        help="the bare client's event loop (asyncio's: the baseline of perf-f9665d2 and issue 44)")
    parser.add_argument("--json", help="write every pass's figures here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    simulator, url = start_simulator(args.concurrency, args.time_scale, args.profile)
    second: subprocess.Popen | None = None  # the together passes' other simulator
    passes: list[dict[str, Any]] = []
    together: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="tokenmill-bench-runner-") as tmp:
            bodies = Path(tmp) / "bodies.jsonl"  # the first tokenmill pass's; every pass sends the same (seeded)

            def tokenmill(rep: int) -> dict[str, Any]:
                spec = write_workload(Path(tmp) / f"rep{rep}", args.samples // args.samples_per_prompt,
                                      args.max_new_tokens, args.samples_per_prompt)
                return run_child(simulator.pid, "tokenmill", str(spec), url, str(args.concurrency),
                                 str(bodies if rep == 0 else Path(tmp) / "unused.jsonl"))

            def bare() -> dict[str, Any]:
                return run_child(simulator.pid, "bare", url, str(bodies), str(args.concurrency), args.bare_loop)

            for rep in range(args.reps):  # the order flips every repetition
                if rep % 2 == 0:
                    first = tokenmill(rep)
                    passes.append({"tokenmill": first, "bare": bare()})
                else:
                    other = bare()
                    passes.append({"tokenmill": tokenmill(rep), "bare": other})
                assert passes[-1]["tokenmill"]["samples"] == passes[-1]["bare"]["samples"] == args.samples, passes
            sims: list[tuple[subprocess.Popen, str]] = [(simulator, url)]
            if args.together:
                second, second_url = start_simulator(args.concurrency, args.time_scale, args.profile)
                sims.append((second, second_url))
            for rep in range(args.together):
                window = Path(tmp) / f"window{rep}"
                window.mkdir()
                spec = write_workload(Path(tmp) / f"together{rep}", args.samples // args.samples_per_prompt,
                                      args.max_new_tokens, args.samples_per_prompt)
                servers = sims[::1 if rep % 2 == 0 else -1]
                bare_pass = Child(servers[1][0].pid, "bare", servers[1][1], str(bodies), str(args.concurrency),
                                  args.bare_loop, str(window))
                tokenmill_pass = Child(servers[0][0].pid, "tokenmill", str(spec), servers[0][1],
                                       str(args.concurrency), str(Path(tmp) / "unused.jsonl"), str(window))
                together.append({"tokenmill": tokenmill_pass.result(), "bare": bare_pass.result()})
                assert together[-1]["tokenmill"]["samples"] == args.samples, together
    finally:
        for server in (simulator, second):
            if server is not None:
                server.terminate()
                server.wait()
    report(args, passes)
    if together:
        report_together(together)
    if args.json:
        Path(args.json).write_text(json.dumps({"in_turn": passes, "together": together}, indent=1))


def _spread(values: list[float], fmt: str = "{:.3f}") -> str:
    return " / ".join(fmt.format(v) for v in (min(values), statistics.median(values), max(values)))


def report(args: argparse.Namespace, passes: list[dict[str, Any]]) -> None:
    n = args.samples
    print(f"workload: {n} samples ({args.samples_per_prompt} per prompt), concurrency {args.concurrency}, "
          f"max_new_tokens {args.max_new_tokens}, simulator time scale {args.time_scale:g}x, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}; tokenmill on `tokenmill run`'s loop, the bare client on "
          f"{args.bare_loop}'s; min / median / max over {len(passes)} repetitions")
    rows = [("CPU ms per sample", lambda p: p["cpu_s"] / n * 1000, "{:.3f}"),
            ("  of it on the event loop's thread", lambda p: p["loop_cpu_s"] / n * 1000, "{:.3f}"),
            ("samples/s", lambda p: n / p["wall_s"], "{:.0f}"),
            ("process CPU s (start-up incl.)", lambda p: p["process_cpu_s"], "{:.2f}"),
            ("peak RSS MiB", lambda p: p["peak_rss_mib"], "{:.0f}"),
            ("simulator CPU ms per sample", lambda p: p["simulator_cpu_s"] / n * 1000, "{:.3f}")]
    print(f"{'':<32}{'tokenmill':>26}{'bare aiohttp':>26}")
    for label, get, fmt in rows:
        print(f"{label:<32}{_spread([get(p['tokenmill']) for p in passes], fmt):>26}"
              f"{_spread([get(p['bare']) for p in passes], fmt):>26}")
    cpu = [p["tokenmill"]["cpu_s"] / p["bare"]["cpu_s"] for p in passes]
    rate = [p["bare"]["wall_s"] / p["tokenmill"]["wall_s"] for p in passes]
    print(f"paired tokenmill / bare: CPU per sample x{_spread(cpu, '{:.2f}')} (goal <= x1.5); "
          f"samples/s x{_spread(rate, '{:.2f}')} (goal >= x1.0)")
    # Client and simulator share the machine's cores: with both busy, a rate is at most cores / (the client's CPU
    # per sample + the simulator's), whatever the client does with its own share of them.
    cores = os.cpu_count() or 1
    bound = {kind: [cores / ((p[kind]["cpu_s"] + p[kind]["simulator_cpu_s"]) / n) for p in passes]
             for kind in ("tokenmill", "bare")}
    print(f"CPU-bound ceiling on {cores} cores (cores / (client + simulator CPU per sample)): tokenmill "
          f"{_spread(bound['tokenmill'], '{:.0f}')}/s, bare {_spread(bound['bare'], '{:.0f}')}/s")


def report_together(together: list[dict[str, Any]]) -> None:
    """Both clients at once: each one's own samples (the bare client's are as many as it answered in the window)."""
    def per_sample(kind: str, key: str) -> list[float]:
        return [p[kind][key] / p[kind]["samples"] * 1000 for p in together]

    print(f"at once, each on its own simulator (swapped every repetition), over {len(together)} repetitions:")
    for label, key in (("CPU ms per sample", "cpu_s"), ("  of it on the event loop's thread", "loop_cpu_s")):
        print(f"{label:<32}{_spread(per_sample('tokenmill', key)):>26}{_spread(per_sample('bare', key)):>26}")
    cpu = [t / b for t, b in zip(per_sample("tokenmill", "cpu_s"), per_sample("bare", "cpu_s"), strict=True)]
    print(f"paired tokenmill / bare at once: CPU per sample x{_spread(cpu, '{:.2f}')} (goal <= x1.5)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        kind, rest = sys.argv[2], sys.argv[3:]
        if kind == "tokenmill":
            answer = child_tokenmill(rest[0], rest[1], int(rest[2]), rest[3], *rest[4:5])
        else:
            answer = child_bare(rest[0], rest[1], int(rest[2]), rest[3], *rest[4:5])
        print(json.dumps(answer))
    else:
        main()
