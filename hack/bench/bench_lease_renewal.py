#!/usr/bin/env python3
"""Shared-lease renewal of a DatasetGeneration's workers at production timings, f9665d2's rule beside today's. Not a
test.

N workers of one DatasetGeneration join one `lease.json` together and renew it with the real LeaseKeeper thread
(stale period 120 s: a round every 20 s, commits fenced past 90 s without a proof) on a real S3 server (moto over
HTTP, its own process), each request held for half the round trip of an S3 region on its way there and half on its
way back (--rtt-ms; a proxy in front of the server, as tests/faults/s3_proxy.py is, ran out of connections at 640
workers). Two groups of each size run side by side on their own prefixes of one bucket: today's `store/lease.py`,
and f9665d2's, read from git (two conditional writes a round, dated by the answer, a silent miss after two 412s;
joins give up after 64 tries). The sizes run one after the other. Per group:

- joins refused: workers whose acquire raised LeaseHeld (the lease kept changing), then joined one at a time;
- rounds / missed: renewal rounds, and those after which the worker's proof had not moved forward;
- oldest proof: the largest age of a worker's proof, sampled every second from its join on (commits stop past
  90 s, LeaseLost at 120 s), and how many workers went past each;
- lost: workers whose keeper concluded the lease was lost;
- requests per round on lease.json.

    .venv/bin/python hack/bench/bench_lease_renewal.py [--workers 64 256] [--seconds 150] [--rtt-ms 50]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests import s3_server  # noqa: E402
from tokenmill_runner.store import lease as current  # noqa: E402
from tokenmill_runner.store.manifest import Owner  # noqa: E402
from tokenmill_runner.store.storage import open_storage, s3_client  # noqa: E402

OLD_COMMIT = "f9665d2"
WORKERS_PER_CLIENT = 16  # S3Storage's pool holds 32 connections: no worker waits for another's
# The S3 server runs as a process of its own: in this one it would share the interpreter's lock with hundreds of
# renewing threads, and the round trip measured would be that contention.


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_listening(port: int) -> None:
    import socket

    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on port {port}")


def old_lease_module() -> ModuleType:
    """f9665d2's store/lease.py, loaded beside today's (its imports resolve to today's store package)."""
    source = subprocess.run(["git", "show", f"{OLD_COMMIT}:runner/tokenmill_runner/store/lease.py"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout
    name = "tokenmill_runner.store._lease_f9665d2"
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "tokenmill_runner.store"
    sys.modules[name] = module
    exec(compile(source, f"{OLD_COMMIT}:store/lease.py", "exec"), module.__dict__)  # noqa: S102 - our own history
    return module


@dataclass
class Group:
    rule: str
    module: Any
    workers: int
    prefix: str
    keepers: list[Any] = field(default_factory=list)
    refused: int = 0
    requests: int = 0
    rounds: int = 0
    missed: int = 0
    oldest: dict[int, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    in_round: threading.local = field(default_factory=threading.local)  # requests are counted within rounds

    def join(self, endpoint: str, bucket: str, rtt_s: float) -> None:
        owner = Owner(kind="DatasetGeneration", name=f"dg-{self.rule}-{self.workers}", namespace="bench", uid="u1")
        clients = [self._counted(open_storage(f"s3://{bucket}/{self.prefix}/", endpoint), rtt_s)
                   for _ in range(0, self.workers, WORKERS_PER_CLIENT)]
        def one(index: int) -> None:
            storage = clients[index // WORKERS_PER_CLIENT]
            try:
                acquired = self.module.acquire(storage, owner, f"pod-{index}", f"{index:016x}")
            except self.module.LeaseHeld:
                with self.lock:
                    self.refused += 1
                return
            self._keep(storage, acquired)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(self.workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for index in range(self.workers - len(self.keepers)):  # refused: joined one at a time, N workers renew
            storage = clients[index // WORKERS_PER_CLIENT]
            self._keep(storage, self.module.acquire(storage, owner, f"pod-late-{index}", f"{index:015x}f"))

    def _keep(self, storage: Any, acquired: Any) -> None:
        """Renew from the worker's join on, as a runner does."""
        keeper = self.module.LeaseKeeper(storage, acquired)
        self._count_rounds(keeper)
        with self.lock:
            self.keepers.append(keeper)
        keeper.start()

    def _counted(self, storage: Any, rtt_s: float) -> Any:
        """The storage, counting its requests on the lease (a conditional write, a read), each held for half the
        round trip before it is sent and half after its answer."""
        for name in ("put_replacing", "put_new", "get_versioned"):
            method = getattr(storage, name)

            def counted(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
                if getattr(self.in_round, "on", False):
                    with self.lock:
                        self.requests += 1
                time.sleep(rtt_s / 2)
                try:
                    return _method(*args, **kwargs)
                finally:
                    time.sleep(rtt_s / 2)

            setattr(storage, name, counted)
        return storage

    def _count_rounds(self, keeper: Any) -> None:
        renew = keeper.renew

        def counted() -> Any:
            before = keeper._renewed_at
            self.in_round.on = True
            try:
                result = renew()
            finally:
                self.in_round.on = False
            with self.lock:
                self.rounds += 1
                self.missed += keeper._renewed_at <= before and not keeper.lost.is_set()
            return result

        keeper.renew = counted

    def sample(self) -> None:
        now = current.boottime()
        with self.lock:
            keepers = list(self.keepers)
        for index, keeper in enumerate(keepers):
            self.oldest[index] = max(self.oldest.get(index, 0.0), now - keeper._renewed_at)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--seconds", type=float, default=150.0, help="renewing, after every worker joined")
    parser.add_argument("--rtt-ms", type=float, default=50.0, help="added to every request to S3")
    args = parser.parse_args()
    os.environ.pop(current.STALE_ENV, None)  # production timings
    for name, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(name, value)
    old = old_lease_module()
    port = free_port()
    server = s3_server.spawn(port)
    times = current.lease_times()
    results: list[tuple[Group, float]] = []
    try:
        wait_listening(port)
        endpoint = f"http://127.0.0.1:{port}"
        s3_client(endpoint).create_bucket(Bucket="bench")
        for size in args.workers:
            groups = [Group(rule, module, size, f"{rule}-{size}") for rule, module in ((OLD_COMMIT, old),
                                                                                       ("today", current))]
            started = time.monotonic()
            joins = [threading.Thread(target=group.join, args=(endpoint, "bench", args.rtt_ms / 1000))
                     for group in groups]
            for thread in joins:
                thread.start()
            deadline = time.monotonic() + args.seconds
            while time.monotonic() < deadline or any(thread.is_alive() for thread in joins):
                for group in groups:
                    group.sample()
                time.sleep(1.0)
            for thread in joins:
                thread.join()
            for group in groups:
                group.sample()
                for keeper in group.keepers:
                    keeper._stop.set()  # stop renewing; a Job's worker never releases (nothing to write)
                results.append((group, time.monotonic() - started))
            for group in groups:
                for keeper in group.keepers:
                    keeper._thread.join()
    finally:
        server.terminate()
        server.wait(30)
    fence_s, stale_s = times.stale_s - times.margin_s, times.stale_s
    print(f"shared-lease renewal at production timings (a round every {times.renew_every_s:.0f} s, commits stop past "
          f"{fence_s:.0f} s without a proof, LeaseLost at {stale_s:.0f} s), moto over HTTP, {args.rtt_ms:.0f} ms a "
          f"round trip; each size {args.seconds:.0f} s from the start of its joins")
    print(f"{'rule':<9} {'workers':>7} {'joins refused':>13} {'rounds':>7} {'missed':>7} {'missed %':>8} "
          f"{'oldest proof s':>14} {'past fence':>10} {'past stale':>10} {'lost':>5} {'req/round':>9}")
    for group, _ in results:
        ages = list(group.oldest.values())
        lost = sum(keeper.lost.is_set() for keeper in group.keepers)
        print(f"{group.rule:<9} {group.workers:>7} {group.refused:>13} {group.rounds:>7} {group.missed:>7} "
              f"{100 * group.missed / max(1, group.rounds):>7.1f}% {max(ages):>14.1f} "
              f"{sum(age > fence_s for age in ages):>10} {sum(age >= stale_s for age in ages):>10} {lost:>5} "
              f"{group.requests / max(1, group.rounds):>9.2f}")


if __name__ == "__main__":
    main()
