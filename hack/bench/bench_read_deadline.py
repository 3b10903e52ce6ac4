#!/usr/bin/env python3
"""What the operator's read deadlines cost (operator/tokenmill_operator/observe/deadline.py), side by side in one run.

The deadline sees every socket through a process-wide audit hook, so every audited event of the operator process
pays a call (a file opened, a socket made), inside a read or not; and every call to a tenant's store goes through
TenantStorage (a scope opened, watched and closed). Each pair runs in its own child process, the same work with and
without the mechanism, and prints the ratio. Not a test.

    .venv/bin/python hack/bench/bench_read_deadline.py [--events 200000] [--reads 2000]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

CHILD = textwrap.dedent("""
    import os, socket, sys, time
    from pathlib import Path
    from tokenmill_operator.observe import deadline
    from tokenmill_operator.observe.tenant_store import TenantStorage
    from tokenmill_runner.store.storage import LocalStorage
    hooked, events, reads, folder = sys.argv[1] == "1", int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    if hooked:
        deadline.install()
    started = time.perf_counter()
    for _ in range(events):  # audited events outside any read: 'open', 'socket.__new__'
        open(os.devnull, "rb").close()
        socket.socket().close()
    events_s = time.perf_counter() - started
    store = LocalStorage(folder)
    with deadline.pass_scope(3600, "bench", 1 << 40):
        wrapped = TenantStorage(store) if hooked else store
        started = time.perf_counter()
        for i in range(reads):
            wrapped.get(f"o{i % 10}")
        reads_s = time.perf_counter() - started
    print(events_s, reads_s)
""")


def run(hooked: bool, events: int, reads: int, folder: str) -> tuple[float, float]:
    done = subprocess.run([sys.executable, "-c", CHILD, "1" if hooked else "0", str(events), str(reads), folder],
                          check=True, capture_output=True, text=True)
    first, second = done.stdout.split()
    return float(first), float(second)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--reads", type=int, default=2_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        for i in range(10):
            Path(folder, f"o{i}").write_bytes(b"x" * 4096)
        plain = run(False, args.events, args.reads, folder)
        hooked = run(True, args.events, args.reads, folder)
    print(f"{args.events:,} x (open + socket) outside a read: {plain[0]:.2f} s plain, {hooked[0]:.2f} s with the hook "
          f"(x{hooked[0] / plain[0]:.2f})")
    print(f"{args.reads:,} store reads of 4 KiB: {plain[1] * 1e6 / args.reads:.0f} us each plain, "
          f"{hooked[1] * 1e6 / args.reads:.0f} us through TenantStorage (x{hooked[1] / plain[1]:.2f})")


if __name__ == "__main__":
    main()
