#!/usr/bin/env python3
"""Runner vs. a plain baseline client, same workload, same simulator, one run.

The simulator runs in its own process at a high time scale so the server side is never the bottleneck and its
CPU is not counted. Both clients run in this process, one after the other, against the same server:
- baseline: a thread pool posting the pre-tokenized requests with `requests` + `json`, results kept in memory;
- tokenmill: the full pipeline (read + validate + tokenize + /generate + Parquet shards + commit markers).
Reported: samples/s and CPU seconds per 1,000 samples for both, and the ratios. Not a test.

    .venv/bin/python hack/bench/bench_runner.py [--samples 3000] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import yaml

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "examples" / "demo-model"
sys.path.insert(0, str(REPO / "runner"))

from tokenmill_runner.prepare import prepare  # noqa: E402
from tokenmill_runner.render.pretokenize import PromptEncoder, load_tokenizer  # noqa: E402
from tokenmill_runner.source.reader import read_prompts  # noqa: E402
from tokenmill_runner.spec.config import RunnerConfig  # noqa: E402
from tokenmill_runner.spec.resource import load_spec_file  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_simulator(max_running: int, time_scale: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenmill_runner.cli", "-q", "sim-server", "--model-path", str(MODEL),
         "--port", str(port), "--time-scale", str(time_scale), "--max-running-requests", str(max_running)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
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


def run_baseline(url: str, bodies: list[dict], concurrency: int) -> tuple[float, float]:
    session = requests.Session()
    adapter = requests.adapters.HTTPAdapter(pool_connections=concurrency, pool_maxsize=concurrency)
    session.mount("http://", adapter)

    def post(body: dict) -> dict:
        response = session.post(f"{url}/generate", data=json.dumps(body),
                                headers={"Content-Type": "application/json"}, timeout=600)
        response.raise_for_status()
        return json.loads(response.text)

    wall, cpu = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(post, bodies))
    assert len(results) == len(bodies)
    return time.perf_counter() - wall, time.process_time() - cpu


def run_tokenmill(spec_path: Path, url: str, concurrency: int) -> tuple[float, float, int]:
    resource = load_spec_file(spec_path)
    spec = resource.spec.model_copy(update={"runner": resource.spec.runner.model_copy(
        update={"concurrency": concurrency})})
    config = RunnerConfig(spec=spec, servers=[url], output_uri=spec.output.uri, progress_log_s=3600)

    async def go() -> tuple[float, float, int]:
        runner = await prepare(config, api_key=None)
        wall, cpu = time.perf_counter(), time.process_time()
        summary = await runner.run()
        return time.perf_counter() - wall, time.process_time() - cpu, summary.datasets[0].generated

    return asyncio.run(go())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--time-scale", type=float, default=20000.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    simulator, url = start_simulator(max_running=args.concurrency, time_scale=args.time_scale)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            spec_path = write_workload(Path(tmp), args.samples, args.max_new_tokens)
            encoder = PromptEncoder(load_tokenizer(str(MODEL)))
            prompts = list(read_prompts(str(Path(tmp) / "prompts.jsonl"), "jsonl"))
            bodies = [{"input_ids": ids, "sampling_params": {"max_new_tokens": args.max_new_tokens}}
                      for ids in encoder.encode_batch(prompts)]
            base_wall, base_cpu = run_baseline(url, bodies, args.concurrency)
            tm_wall, tm_cpu, generated = run_tokenmill(spec_path, url, args.concurrency)
            assert generated == args.samples, generated
    finally:
        simulator.terminate()
        simulator.wait()
    n = args.samples / 1000
    print(f"workload: {args.samples} samples, concurrency {args.concurrency}, max_new_tokens {args.max_new_tokens}, "
          f"simulator time scale {args.time_scale:g}x, {os.cpu_count()} CPUs")
    print(f"{'client':<12} {'samples/s':>10} {'CPU s / 1000 samples':>22}")
    print(f"{'baseline':<12} {args.samples / base_wall:>10.1f} {base_cpu / n:>22.2f}")
    print(f"{'tokenmill':<12} {args.samples / tm_wall:>10.1f} {tm_cpu / n:>22.2f}")
    print(f"ratio tokenmill/baseline: throughput {base_wall / tm_wall:.2f}x, CPU per sample {tm_cpu / base_cpu:.2f}x")


if __name__ == "__main__":
    main()
