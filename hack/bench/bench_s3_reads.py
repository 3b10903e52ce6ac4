#!/usr/bin/env python3
"""Reading markers from S3: botocore's GetObject against the store's capped read, side by side in one run. Not a
test (tests/integration/test_capped_reads.py checks what the capped read answers).

The operator's steady pass at 10M samples reads the 1 % of markers that are new (391 GETs of a few KB,
docs/scale.md), 16 at a time (`markers.iter_keyed`). On the moto server the tests use (its own process, on the same
cores) this writes that many marker-sized objects and reads them all, repetitions alternating:
- botocore: `client.get_object(...)["Body"].read()`, what every capped read was before;
- capped: `get_bounded` (the store's `get_capped`: one GET through the client's signer and pool, storage.py).
Reported per way: CPU per GET of this process (its reading threads included), wall per pass, and moto's CPU per
GET (what bounds the wall on two cores: moto serves one request at a time under its GIL); then the paired ratio of
the client CPU.

    .venv/bin/python hack/bench/bench_s3_reads.py [--objects 391] [--bytes 1500] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")

from bench_runner import process_cpu_s  # noqa: E402 - after the path and the credentials
from bench_scale import start_moto  # noqa: E402

from tokenmill_runner.store.bounded_get import MARKER_BYTES, get_bounded  # noqa: E402
from tokenmill_runner.store.markers import READ_THREADS  # noqa: E402
from tokenmill_runner.store.storage import S3Storage, open_storage  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects", type=int, default=391)
    parser.add_argument("--bytes", type=int, default=1500, help="each object's size (a marker of 256 samples)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    moto, endpoint = start_moto()
    try:
        storage = open_storage("s3://bench/markers/", endpoint)
        assert isinstance(storage, S3Storage)
        client = storage._client
        keys = [f"d/commits/{i:08d}.json" for i in range(args.objects)]
        body = b"x" * args.bytes
        with ThreadPoolExecutor(READ_THREADS) as pool:
            list(pool.map(lambda key: storage.put(key, body), keys))

        def botocore_get(key: str) -> bytes:
            return client.get_object(Bucket="bench", Key="markers/" + key)["Body"].read()  # type: ignore[no-any-return]

        def capped_get(key: str) -> bytes:
            return get_bounded(storage, key, MARKER_BYTES)

        ways: dict[str, Callable[[str], bytes]] = {"botocore": botocore_get, "capped": capped_get}
        results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in ways}
        with ThreadPoolExecutor(READ_THREADS) as pool:
            for name, way in ways.items():  # a warm-up pass each: connections, the endpoint's rules
                assert all(data == body for data in pool.map(way, keys)), name
            for rep in range(args.reps):
                for name in (list(ways) if rep % 2 == 0 else list(reversed(ways))):
                    cpu, moto_cpu, wall = time.process_time(), process_cpu_s(moto.pid), time.perf_counter()
                    assert all(data == body for data in pool.map(ways[name], keys)), name
                    results[name].append((time.process_time() - cpu, process_cpu_s(moto.pid) - moto_cpu,
                                          time.perf_counter() - wall))
    finally:
        moto.terminate()
        moto.wait()

    per_get = 1000 / args.objects
    print(f"{args.objects} objects of {args.bytes} bytes, {READ_THREADS} at a time, {args.reps} reps; median (min-max)")
    for name, rows in results.items():
        cpu, served, wall = ([row[i] for row in rows] for i in range(3))
        print(f"  {name:9} client CPU {statistics.median(cpu) * per_get:.3f} ms/GET "
              f"({min(cpu) * per_get:.3f}-{max(cpu) * per_get:.3f}); moto CPU "
              f"{statistics.median(served) * per_get:.3f} ms/GET; pass {statistics.median(wall):.3f} s "
              f"({min(wall):.3f}-{max(wall):.3f})")
    ratios = [capped[0] / boto[0] for capped, boto in zip(results["capped"], results["botocore"], strict=True)]
    print(f"  client CPU capped / botocore: x{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
