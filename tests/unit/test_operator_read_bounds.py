"""The operator's reads of what a tenant controls, bounded by what they cost (docs/security.md, "The operator's
reads"): a wall-clock deadline that closes the connection (not a per-recv timeout), a byte budget per pass, /metrics
read without redirects and within its cap, and reconcile threads shared fairly across namespaces
(security-f9665d2.md B3, B4, W3, W4). Each bound is tried at and past it against real sockets."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tokenmill_operator.decide.server_metrics import parse_metrics
from tokenmill_operator.observe import deadline
from tokenmill_operator.observe.sglang_metrics import read_metrics
from tokenmill_operator.observe.tenant_store import LISTED_KEY_BYTES, ReadRefused, TenantStorage
from tokenmill_operator.passes import FairSlots, PassScheduler
from tokenmill_runner.store.storage import LocalStorage, StorageRetry, open_storage

from ..hostile_endpoint import Endpoint, answered, trickle

# What a deadline may overrun by on a loaded machine: generous, and far below what the attacks held (minutes).
SLACK_S = 10.0
METRICS = b"sglang:num_running_reqs 4\nsglang:gen_throughput 400\n"


@pytest.fixture
def endpoints() -> Iterator[Callable[[Callable[[socket.socket, int], None]], Endpoint]]:
    made: list[Endpoint] = []

    def make(answer: Callable[[socket.socket, int], None]) -> Endpoint:
        made.append(Endpoint(answer))
        return made[-1]

    yield make
    for endpoint in made:
        endpoint.close()


def tenant_s3(url: str, read_seconds: float) -> TenantStorage:
    keys = {"AWS_ACCESS_KEY_ID": "AKIATENANT", "AWS_SECRET_ACCESS_KEY": "secret"}
    return TenantStorage(open_storage("s3://b/p/", url, None, keys, StorageRetry(budget_s=10)), read_seconds)


# -- the deadline closes the connection -----------------------------------------------------------------------------
def test_a_trickling_metrics_answer_is_cut_at_its_deadline_and_its_connection_closed(endpoints):
    server = endpoints(lambda conn, _: trickle(conn))
    started = time.monotonic()
    assert read_metrics(server.url, timeout_s=0.3) is None  # f9665d2: 3 s per recv, so for as long as bytes came
    assert time.monotonic() - started < SLACK_S
    assert server.closed.wait(SLACK_S), "the operator's side of the connection stayed open"


def test_a_trickling_store_is_cut_at_the_reads_deadline_and_retried_no_more(endpoints):
    server = endpoints(lambda conn, _: trickle(conn))
    with deadline.pass_scope(60, "the pass"):
        store = tenant_s3(server.url, read_seconds=0.3)
        started = time.monotonic()
        with pytest.raises(ReadRefused, match="past its deadline of 0.3s"):
            store.get("config.json")
    assert time.monotonic() - started < SLACK_S
    assert server.closed.wait(SLACK_S)
    assert len(server.requests) == 1, "a read cut off is not retried by botocore or the store's retry loop"


def test_the_pass_deadline_cuts_a_read_whose_own_deadline_is_later_and_refuses_the_next_unsent(endpoints):
    server = endpoints(lambda conn, _: trickle(conn))
    with deadline.pass_scope(0.3, "the pass of team-a/x"):
        store = tenant_s3(server.url, read_seconds=30)
        with pytest.raises(ReadRefused, match="the pass of team-a/x: past its deadline"):
            store.get("config.json")
        with pytest.raises(ReadRefused):
            store.get("run.json")
    assert len(server.requests) == 1, "past the pass's deadline no request is sent"


def test_a_kept_alive_connection_is_cut_at_the_deadline_of_the_read_it_serves(endpoints):
    # The first answer is quick and keeps the connection; the second, on the same connection, trickles.
    server = endpoints(lambda conn, number: answered(b"{}")(conn, number) if number == 0 else trickle(conn))
    with deadline.pass_scope(60, "the pass"):
        store = tenant_s3(server.url, read_seconds=0.5)
        assert store.get("run.json") == b"{}"
        started = time.monotonic()
        with pytest.raises(ReadRefused, match="past its deadline of 0.5s"):
            store.get("config.json")
    assert time.monotonic() - started < SLACK_S


def test_a_read_within_its_deadline_is_untouched(endpoints):
    server = endpoints(answered(METRICS))
    with deadline.pass_scope(60, "the pass"):
        assert read_metrics(server.url, timeout_s=5).running == 4
        assert tenant_s3(server.url, 5).get("config.json") == METRICS


# -- the pass's byte budget ---------------------------------------------------------------------------------------
def test_a_pass_reads_up_to_its_byte_budget_and_no_further(tmp_path: Path):
    for name in ("a", "b", "c"):
        (tmp_path / name).write_bytes(b"x" * 40)
    with deadline.pass_scope(60, "the pass", budget_bytes=80):
        store = TenantStorage(LocalStorage(tmp_path))
        assert store.get("a") + store.get("b") == b"x" * 80  # at the budget
        with pytest.raises(ReadRefused, match="read 120 bytes, over its budget of 80"):
            store.get("c")
    with deadline.pass_scope(60, "the pass", budget_bytes=40 + 2 * LISTED_KEY_BYTES):
        store = TenantStorage(LocalStorage(tmp_path))
        with store.open_read("a") as body:
            assert body.read() == b"x" * 40  # streamed bytes count too
        listing = store.list("")
        assert [next(listing), next(listing)] == ["a", "b"]
        with pytest.raises(ReadRefused, match="over its budget"):
            next(listing)  # each listed key counts: a listing of millions of markers is cut too (W3)


# -- /metrics: the address asked, nothing else --------------------------------------------------------------------
def test_metrics_follow_no_redirect_to_another_tenants_server_or_an_internal_address(endpoints):
    other = endpoints(answered(b"sglang:num_running_reqs 37\nsglang:gen_throughput 1850.5\n"))
    for target in (f"{other.url}/metrics", f"{other.url}/latest/meta-data/iam/security-credentials/",
                   f"ftp://127.0.0.1:{other.port}/x"):
        redirecting = endpoints(answered(b"", "302 Found", f"Location: {target}\r\n"))
        assert read_metrics(redirecting.url) is None  # f9665d2: Scrape(running=37.0, ...) of the other server
    assert other.requests == [], "no request left for an address the spec did not name (B4)"


def test_metrics_are_read_only_over_plain_http_from_a_host():
    for url in ("ftp://127.0.0.1:21", "file:///etc/passwd", "https://127.0.0.1:1", "http://user:pw@127.0.0.1:1",
                "http:///metrics"):
        assert read_metrics(url) is None, url


def test_metrics_are_read_up_to_their_cap_and_refused_past_it(endpoints):
    exact = endpoints(answered(METRICS))
    assert read_metrics(exact.url, max_bytes=len(METRICS)).running == 4
    over = endpoints(answered(METRICS + b"#"))
    assert read_metrics(over.url, max_bytes=len(METRICS)) is None


def test_a_long_metrics_answer_is_parsed_line_by_line():
    # W4: 4 MiB of short lines split at once held ~100 MB per replica, 16 replicas at once 594 MB.
    text = ("x 1\n" * (1 << 16)) + METRICS.decode()
    tracemalloc.start()
    try:
        parse_metrics(text)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 19, f"{peak} bytes to parse {len(text)} characters"  # f9665d2: ~4 MB


# -- the reconcile threads are shared fairly -----------------------------------------------------------------------
def test_a_namespace_holding_its_share_of_threads_delays_no_other_namespace():
    # B3: four team-a resources held all four threads and team-b's pass was not run 151 s after it was asked.
    release, started, lock = threading.Event(), [], threading.Lock()

    def run(key, stopped):
        with lock:
            started.append(key[0])
        if key[0] == "team-a":
            release.wait(SLACK_S)
        return key

    async def scenario() -> list[str]:
        scheduler = PassScheduler(run, lambda key, result: None, max_workers=4, per_namespace=2)
        for index in range(6):
            scheduler.request(("team-a", f"slow-{index}", f"uid-a{index}"))
        victim = scheduler.request(("team-b", "victim", "uid-b"))
        await asyncio.wait_for(asyncio.shield(victim), SLACK_S)  # f9665d2: never, while team-a held every thread
        seen = list(started)
        release.set()
        await scheduler.idle()
        return seen

    seen = asyncio.run(scenario())
    assert seen.count("team-a") == 2 and "team-b" in seen, seen


def test_free_threads_go_round_robin_to_the_namespaces_that_wait():
    async def scenario() -> list[str]:
        slots = FairSlots(workers=3, per_namespace=2)
        order: list[str] = []
        for holder in ("x", "y", "z"):  # every thread held
            await slots.acquire(holder)

        async def wait(namespace: str) -> None:
            await slots.acquire(namespace)
            order.append(namespace)

        waiters = [asyncio.create_task(wait(ns)) for ns in ("a", "a", "b", "c")]
        await asyncio.sleep(0)
        for holder in ("x", "y", "z", "a"):
            slots.release(holder)
            await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.gather(*waiters), SLACK_S)
        return order

    order = asyncio.run(scenario())
    assert order == ["a", "b", "c", "a"], "each waiting namespace in turn, not a's second pass before b and c"


def test_one_namespace_never_holds_every_thread():
    assert FairSlots(workers=4, per_namespace=8).per_namespace == 3
    assert FairSlots(workers=1, per_namespace=2).per_namespace == 1
