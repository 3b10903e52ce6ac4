"""A fault-injecting HTTP proxy to put in front of the test S3 server (moto's), for storage fault tests.

Point an S3 client's endpoint at `proxy.url` instead of the S3 server's, then add rules. Each request is matched
against the rules in order; the first rule whose method and path pattern match, and which has not been used up,
acts on it:

    status          answer at once with an S3 error (default 503 SlowDown); the server never sees the request
    delay           wait `delay_s` seconds, then forward (a slow answer)
    reset_request   forward the request head and `after_bytes` of its body, then reset both connections
                    (a connection reset in the middle of an upload)
    reset_response  forward the request, relay the answer's head and `after_bytes` of its body, then reset the
                    connection (a download broken in the middle of the body)

`skip` lets that many matching requests through first; `times` is how many it then acts on. Every request is
logged (`proxy.events`: method, path, Range header, the action taken) so a test can assert that each fault fired.
Each request gets its own upstream connection (`Connection: close`), so a reset never affects another request.

    with S3FaultProxy(s3_endpoint) as proxy:
        proxy.add(Rule("reset_response", method="GET", path=r"/prompts\\.jsonl", after_bytes=50_000, times=2))
        storage = S3Storage("s3://bucket/run/", endpoint=proxy.url)

The operator's fault tests switch the proxy's whole behaviour while it runs: `proxy.only(Rule("status",
times=FOREVER))` replaces every rule with one that acts on every request; `proxy.clear()` lets everything through.
"""

from __future__ import annotations

import asyncio
import re
import socket
import struct
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field
from urllib.parse import urlsplit

ACTIONS = ("status", "delay", "reset_request", "reset_response")
REASONS = {403: "Forbidden", 500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable",
           504: "Gateway Timeout"}
CODES = {403: "AccessDenied", 500: "InternalError", 503: "SlowDown"}
FOREVER = 1 << 62  # a rule's `times` that never runs out


@dataclass
class Rule:
    action: str
    method: str | None = None  # GET, PUT, HEAD, DELETE...; None matches every method
    path: str = ""  # a regular expression searched in the request target (path and query)
    times: int = 1  # matching requests acted on, after `skip`
    skip: int = 0  # matching requests let through before acting
    status: int = 503
    delay_s: float = 1.0
    after_bytes: int = 0
    matched: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}; use one of {', '.join(ACTIONS)}")

    def take(self, method: str, target: str) -> bool:
        """Whether this rule acts on the request (counting it when it matches)."""
        if (self.method and self.method != method) or not re.search(self.path, target):
            return False
        self.matched += 1
        return self.skip < self.matched <= self.skip + self.times


@dataclass(frozen=True)
class Event:
    method: str
    target: str
    range: str | None
    action: str  # "pass" or the rule's action


class S3FaultProxy:
    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.rules: list[Rule] = []
        self.events: list[Event] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="s3-fault-proxy")
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- control (any thread) ------------------------------------------------------------------------------
    def add(self, rule: Rule) -> Rule:
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()

    def only(self, rule: Rule) -> Rule:
        """Replace every rule with this one."""
        with self._lock:
            self.rules[:] = [rule]
        return rule

    def wait_fired(self, action: str, count: int = 1, timeout: float = 60) -> None:
        """Until `action` has acted on `count` requests (a `delay` fires as its request starts waiting)."""
        deadline = time.monotonic() + timeout
        while len(self.fired(action)) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"the proxy's {action} rule acted on fewer than {count} requests in {timeout} s")
            time.sleep(0.02)

    def fired(self, action: str | None = None, path: str = "") -> list[Event]:
        with self._lock:
            return [e for e in self.events if e.action != "pass" and (action is None or e.action == action)
                    and re.search(path, e.target)]

    def requests(self, method: str | None = None, path: str = "") -> list[Event]:
        with self._lock:
            return [e for e in self.events if (method is None or e.method == method) and re.search(path, e.target)]

    def __enter__(self) -> S3FaultProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the fault proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    # -- serving (the proxy's thread) ----------------------------------------------------------------------
    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._server.close()
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.close()

    def _decide(self, method: str, target: str, headers: dict[str, str]) -> Rule | None:
        with self._lock:
            rule = next((r for r in self.rules if r.take(method, target)), None)
            self.events.append(Event(method, target, headers.get("range"), rule.action if rule else "pass"))
            return rule

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            head = await client_reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            client_writer.close()
            return
        method, target, headers = _parse_head(head)
        rule = self._decide(method, target, headers)
        if rule is not None and rule.action == "status":
            client_writer.write(_error_answer(rule.status, method))
            await _close(client_writer)
            return
        if rule is not None and rule.action == "delay":
            await asyncio.sleep(rule.delay_s)
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            _reset(client_writer)
            return
        upstream_writer.write(_close_after(head))
        if rule is not None and rule.action == "reset_request":
            await self._reset_request(rule, client_reader, client_writer, upstream_reader, upstream_writer)
        elif rule is not None and rule.action == "reset_response":
            await self._reset_response(rule, client_reader, client_writer, upstream_reader, upstream_writer)
        else:
            await self._relay(client_reader, client_writer, upstream_reader, upstream_writer)

    async def _relay(self, client_reader, client_writer, upstream_reader, upstream_writer) -> None:
        up = asyncio.create_task(_pipe(client_reader, upstream_writer))
        await _pipe(upstream_reader, client_writer)
        up.cancel()
        await _close(client_writer)
        await _close(upstream_writer)

    async def _reset_request(self, rule, client_reader, client_writer, upstream_reader, upstream_writer) -> None:
        # The answer's head (a `100 Continue`) may be needed for the client to send its body at all.
        down = asyncio.create_task(_pipe(upstream_reader, client_writer))
        await _pipe(client_reader, upstream_writer, limit=rule.after_bytes)
        down.cancel()
        _reset(client_writer)
        _reset(upstream_writer)

    async def _reset_response(self, rule, client_reader, client_writer, upstream_reader, upstream_writer) -> None:
        up = asyncio.create_task(_pipe(client_reader, upstream_writer))
        try:
            while True:  # relay interim answers (100 Continue) whole, then the final head
                answer_head = await upstream_reader.readuntil(b"\r\n\r\n")
                client_writer.write(answer_head)
                if not answer_head.split(b" ", 2)[1].startswith(b"1"):
                    break
            await _pipe(upstream_reader, client_writer, limit=rule.after_bytes)
            await client_writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        up.cancel()
        _reset(client_writer)
        _reset(upstream_writer)


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    method, target, *_ = lines[0].split(" ") + ["", ""]
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return method, target, headers


def _close_after(head: bytes) -> bytes:
    """The request head with `Connection: close`, so the upstream answers one request on this connection."""
    lines = head.decode("latin-1").split("\r\n")
    kept = [line for line in lines[:-2] if not line.lower().startswith("connection:")]
    return ("\r\n".join([*kept, "Connection: close"]) + "\r\n\r\n").encode("latin-1")


def _error_answer(status: int, method: str) -> bytes:
    code = CODES.get(status, "ServiceUnavailable")
    body = b"" if method == "HEAD" else (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>injected by the test fault '
        f"proxy</Message></Error>").encode()
    head = (f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, limit: int | None = None) -> int:
    sent = 0
    try:
        while limit is None or sent < limit:
            chunk = await reader.read(65536 if limit is None else min(65536, limit - sent))
            if not chunk:
                break
            writer.write(chunk)
            await writer.drain()
            sent += len(chunk)
    except (ConnectionError, asyncio.CancelledError):
        pass
    return sent


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0): the peer sees 'connection reset', not a clean end of stream."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _close(writer: asyncio.StreamWriter) -> None:
    with suppress(Exception):
        await writer.drain()
        writer.close()
        await writer.wait_closed()
