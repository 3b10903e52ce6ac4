#!/usr/bin/env python3
"""The hidden-state capture pass's throughput over 1, 2 and 4 server replicas, side by side in one run.

The capture pass sends every committed sample once more (its prompt + output ids, full prefill) through the stream's
client (generate/client.py), each request to the least loaded live replica, CAPTURE_CONCURRENCY in flight per worker
(generate/hidden_capture.py). Until f9665d2 every capture went to the first --server, so the pass ran at one
replica's speed however many held GPUs. Here `tokenmill sim-server` processes, each a replica whose prefill costs
real time (time scale 1, --prefill-ms-per-1k-tokens), answer SGLang 0.5.23's aux hidden states for a model of hidden
size 64 (so the runner's JSON parsing is small beside the servers' prefill, as on GPUs the prefill is what a replica
adds); the same committed samples are captured into a fresh store for each replica count. Printed: seconds, samples/s
and the ratio to one replica. Not a test.

    .venv/bin/python hack/bench/bench_capture_replicas.py [--samples 48] [--tokens 512] [--prefill-ms-per-1k 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tokenmill_runner.facts.hidden_states import CAPTURE_CONCURRENCY, StateShape, default_eagle3_layer_ids
from tokenmill_runner.generate.client import GenerateClient
from tokenmill_runner.generate.hidden_capture import capture_dataset
from tokenmill_runner.store.shards import ShardBuffer, commit_shard
from tokenmill_runner.store.storage import LocalStorage

REPO = Path(__file__).resolve().parents[2]
DEMO_MODEL = REPO / "examples" / "demo-model"
HIDDEN = 64
REPLICAS = (1, 2, 4)


def small_model(folder: Path) -> Path:
    shutil.copytree(DEMO_MODEL, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": HIDDEN, "intermediate_size": 128}))
    return folder


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_replica(model: Path, prefill_ms_per_1k: float) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenmill_runner.cli", "-q", "sim-server", "--model-path", str(model), "--port",
         str(port), "--enable-return-aux-hidden-states", "--time-scale", "1", "--step-ms", "5",
         "--prefill-ms-per-1k-tokens", str(prefill_ms_per_1k), "--chunked-prefill-size", "8192"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.1)
    raise SystemExit(f"the simulator on port {port} did not start")


def commit_samples(root: Path, samples: int, tokens: int, vocab: int) -> LocalStorage:
    storage = LocalStorage(root)
    rng = random.Random(7)
    for start in range(0, samples, 16):
        buffer = ShardBuffer(16, 1e9)
        for i in range(start, min(samples, start + 16)):
            prompt = [rng.randrange(5, vocab) for _ in range(tokens - 16)]
            output = [rng.randrange(5, vocab) for _ in range(16)]
            buffer.add_row({"sample_id": f"c{i:05d}", "dataset": "d", "line": i + 1, "sample_index": 0,
                            "prompt_ids": prompt, "output_ids": output, "prompt_tokens": len(prompt),
                            "completion_tokens": len(output), "finish_reason": "length"}, 0.0)
        commit_shard(storage, "d", f"s{start:05d}", 0, buffer.take())
    return storage


async def capture(storage: LocalStorage, urls: list[str]) -> tuple[float, int]:
    shape = StateShape(len(default_eagle3_layer_ids(8)), HIDDEN, "bfloat16")
    client = GenerateClient(urls, concurrency=16, prefix_affine=False)
    try:
        started = time.perf_counter()
        summary = await capture_dataset(storage, "d", client, shape, chunked_prefill_tokens=8192)
        seconds = time.perf_counter() - started
    finally:
        await client.aclose()
    assert not summary.failed, summary.failures[:3]
    return seconds, summary.captured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--prefill-ms-per-1k", type=float, default=1000.0,
                        help="a replica's prefill cost (simulated = real time here)")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-capture-"))
    replicas: list[subprocess.Popen[bytes]] = []
    try:
        model = small_model(scratch / "model")
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        urls = []
        for _ in range(max(REPLICAS)):
            process, url = start_replica(model, args.prefill_ms_per_1k)
            replicas.append(process)
            urls.append(url)
        print(f"{args.samples} samples of {args.tokens} tokens, {CAPTURE_CONCURRENCY} captures in flight, prefill "
              f"{args.prefill_ms_per_1k:g} ms per 1k tokens per replica")
        print(f"{'replicas':>8} {'seconds':>8} {'samples/s':>10} {'x 1 replica':>12}")
        first = None
        for count in REPLICAS:
            storage = commit_samples(scratch / f"out-{count}", args.samples, args.tokens, vocab)
            seconds, captured = asyncio.run(capture(storage, urls[:count]))
            assert captured == args.samples, captured
            rate = captured / seconds
            first = first or rate
            print(f"{count:>8} {seconds:>8.1f} {rate:>10.2f} {rate / first:>12.2f}", flush=True)
    finally:
        for process in replicas:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
