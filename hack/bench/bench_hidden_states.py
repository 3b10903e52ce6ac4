#!/usr/bin/env python3
"""Hidden-state throughput (bytes of states per second) and peak RSS of the runner's capture pass as samples grow.

Each size runs in a child process (its peak RSS read from wait4): committed shards of `--tokens`-token samples are
written to a scratch store, a local HTTP server answers every capture request as SGLang 0.5.23 does (the states as
JSON floats in one prefill block, the token ids echoed; the body is built once per process, so the server costs
little), and generate/hidden_capture.py captures, checks and commits every sample; then each committed file is read
back and digest-checked as an export reads it (store/hidden_states.read_states); then the final-state pass SpecForge's
layout adds (one layer), `--format specforge-offline` (export/offline.py: one .ckpt per sample with both kinds)
and `--format speculators-offline` (export/speculators_offline.py: the Arrow rows and each aux file copied) into
scratch destinations. The scratch store is removed.
Not a test. Defaults: 100 and 1,000 samples of 2,048 tokens at hidden 1,024 x 3 layers (bf16: 12.6 MB a sample,
12.6 GB at the top).

    .venv/bin/python hack/bench/bench_hidden_states.py [--sizes 100 1000] [--tokens 2048] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import asyncio, json, sys, threading, time
from pathlib import Path
import numpy as np, orjson
from aiohttp import web
from tokenmill_runner.facts.hidden_states import StateShape
from tokenmill_runner.generate.hidden_capture import capture_dataset
from tokenmill_runner.export.offline import export_specforge_offline
from tokenmill_runner.export.speculators_offline import export_speculators_offline
from tokenmill_runner.store.hidden_states import FINAL, read_states, state_markers
from tokenmill_runner.store.shards import ShardBuffer, commit_shard
from tokenmill_runner.store.storage import LocalStorage

root, samples, tokens, hidden = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
shape = StateShape(3, hidden, "bfloat16")
storage = LocalStorage(root)
for start in range(0, samples, 64):
    content = ShardBuffer(64, 1e9)
    for i in range(start, min(samples, start + 64)):
        content.add_row({"sample_id": f"h{i:06d}", "dataset": "d", "line": i + 1, "sample_index": 0,
                         "prompt_ids": [(i + p) % 1000 for p in range(tokens - 16)],
                         "output_ids": [(i * 7 + p) % 1000 for p in range(16)], "prompt_tokens": tokens - 16,
                         "completion_tokens": 16, "finish_reason": "length"}, 0.0)
    commit_shard(storage, "d", f"s{start:06d}", 0, content.take())
def answer_states(layers):
    values = (np.arange(tokens * layers * hidden) % 256 - 128) / 64.0
    return orjson.dumps(values.reshape(tokens, -1), option=orjson.OPT_SERIALIZE_NUMPY)

states, final_states = answer_states(3), answer_states(1)

async def generate(request):
    body = orjson.loads(await request.read())
    served = final_states if body["rid"].startswith("hs-final-") else states
    return web.Response(body=b'{"text":"","output_ids":[0],"meta_info":{"id":"x","hidden_states":[' + served
                        + b'],"e2e_latency":0.0},"prompt_token_ids":' + orjson.dumps(body["input_ids"]) + b"}",
                        content_type="application/json")

async def main():
    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    started = time.perf_counter()
    summary = await capture_dataset(storage, "d", f"http://127.0.0.1:{port}", shape, chunked_prefill_tokens=1 << 20,
                                    concurrency=2)
    captured_s = time.perf_counter() - started
    final = await capture_dataset(storage, "d", f"http://127.0.0.1:{port}", StateShape(1, hidden, "bfloat16"),
                                  chunked_prefill_tokens=1 << 20, concurrency=2, kind=FINAL)
    await runner.cleanup()
    assert summary.captured == samples and not summary.failed, summary.failures
    assert final.captured == samples and not final.failed, final.failures
    started = time.perf_counter()
    read = 0
    for marker in state_markers(storage, "d"):
        ids, values = read_states(storage, "d", marker)
        read += values.size * 2
    read_s = time.perf_counter() - started
    started = time.perf_counter()
    manifest = export_specforge_offline(storage, LocalStorage(root.parent / (root.name + "-export")), ["d"],
                                        storage.root_uri, "bench")
    export_s = time.perf_counter() - started
    assert manifest["datasets"]["d"]["written"] == samples, manifest
    # The aux file as speculators' layout stores it (its last layer the final state: layerIds ending at L - 1).
    run = {"spec": {"hiddenStates": {"layouts": ["speculators"], "layerIds": [1, 3, 7]}}}
    started = time.perf_counter()
    spool = root.parent / (root.name + "-spool")
    spool.mkdir()
    speculators = export_speculators_offline(storage, LocalStorage(root.parent / (root.name + "-speculators")), ["d"],
                                             run, spool, 256 << 20, "bench")
    speculators_s = time.perf_counter() - started
    assert speculators["datasets"]["d"]["written"] == samples, speculators
    print(json.dumps({"state_bytes": summary.state_bytes, "capture_s": captured_s, "read_bytes": read,
                      "read_s": read_s, "export_bytes": manifest["datasets"]["d"]["bytes"], "export_s": export_s,
                      "speculators_bytes": speculators["datasets"]["d"]["bytes"], "speculators_s": speculators_s}))

asyncio.run(main())
"""


def run_size(samples: int, tokens: int, hidden: int, scratch: Path) -> dict[str, float]:
    folder = Path(tempfile.mkdtemp(prefix=f"hs-{samples}-", dir=scratch))
    try:
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(folder), str(samples), str(tokens), str(hidden)],
                                 stdout=subprocess.PIPE, text=True)
        _, status, usage = os.wait4(child.pid, 0)
        out = child.stdout.read() if child.stdout else ""
        if status != 0:
            raise SystemExit(f"size {samples}: child failed ({status})")
        figures = json.loads(out.strip().splitlines()[-1])
        figures["peak_rss_mib"] = usage.ru_maxrss / 1024
        return figures
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        for suffix in ("-export", "-speculators", "-spool"):
            shutil.rmtree(f"{folder}{suffix}", ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    need = max(args.sizes) * args.tokens * (3 + 1) * args.hidden * 2 * 3  # both kinds, then the exports' copies
    free = shutil.disk_usage(args.scratch).free
    if need * 1.1 > free:
        raise SystemExit(f"{args.scratch}: {free / 1e9:.1f} GB free, the largest size needs {need / 1e9:.1f} GB")
    print(f"{'samples':>8} {'states GB':>10} {'capture MB/s':>13} {'read MB/s':>10} {'specforge MB/s':>15} "
          f"{'speculators MB/s':>17} {'peak RSS MiB':>13} {'x first':>8}")
    first = None
    for samples in args.sizes:
        f = run_size(samples, args.tokens, args.hidden, args.scratch)
        first = first or f["peak_rss_mib"]
        print(f"{samples:>8} {f['state_bytes'] / 1e9:>10.2f} {f['state_bytes'] / f['capture_s'] / 1e6:>13.1f} "
              f"{f['read_bytes'] / f['read_s'] / 1e6:>10.1f} {f['export_bytes'] / f['export_s'] / 1e6:>15.1f} "
              f"{f['speculators_bytes'] / f['speculators_s'] / 1e6:>17.1f} "
              f"{f['peak_rss_mib']:>13.1f} "
              f"{f['peak_rss_mib'] / first:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
