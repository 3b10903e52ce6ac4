"""POSTs to /generate over keep-alive HTTP/1.1 connections, as lean as a bare client.

The runner sends one request per sample, hundreds in flight: per request it writes the head and the body it was
given and reads the answer (`http11.py`) on an asyncio protocol, nothing more. A general client spent most of the
runner's CPU here (issue 44: httpx/httpcore scanned its pool per request and built its request and response
models; 24 pools each loaded the CA bundle). Idle connections are reused, newest first, until shortly before the
server would close them. Connections go straight to the server (proxy variables are not read; the replicas and the
gateway are reached directly). For https the one TLS context verifies against the CA bundle httpx would use
(SSL_CERT_FILE / SSL_CERT_DIR, else certifi's).
"""

from __future__ import annotations

import asyncio
import os
import select
import ssl
from collections.abc import Mapping
from typing import cast

from .http11 import MAX_ANSWER_BYTES, Answer, AnswerReader, AnswerTooLarge, BadAnswer, Origin, post_head_start

# SGLang (uvicorn) closes idle keep-alive connections after 5 s (0.5.9 entrypoints/http_server.py:1972
# timeout_keep_alive=5; 0.5.23 environ.py:337 SGLANG_TIMEOUT_KEEP_ALIVE=5): drop them first, or a request sent on a
# connection the server is closing fails (and counts against the replica). Idle time runs from the answer's last
# byte; 2 s of margin cover a loop that is late reading it (seen at 1 s and more under a profiler on 2 busy cores).
KEEPALIVE_EXPIRY_S = 3.0
CONNECT_TIMEOUT_S = 30.0


class TransportError(Exception):
    """No HTTP answer came. `connect`: nothing accepted the connection, so the request never reached a server."""

    connect = False


class ConnectFailed(TransportError):
    """The connection was refused or the address does not resolve: nothing listens there."""

    connect = True


class ConnectTimedOut(TransportError):
    """No connection within the connect timeout."""


class AnswerLost(TransportError):
    """The request was sent and the connection broke, timed out or carried no HTTP answer."""


class _Connection(asyncio.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._reader: AnswerReader | None = None
        self._waiter: asyncio.Future[Answer] | None = None
        self.deadline = 0.0  # when the answer in flight is given up (loop time)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream transport (uvloop's is no subclass)

    def data_received(self, data: bytes) -> None:
        if self._reader is None:  # bytes nobody asked for: the exchange is broken
            self.close()
            return
        try:
            answer = self._reader.feed(data)
        except AnswerTooLarge as error:  # not a transport's fault: the caller's limit (a request's own size)
            self._finish(error)
            self.close()
            return
        except BadAnswer as error:
            self._finish(AnswerLost(f"{type(error).__name__}: {error}"))
            self.close()
            return
        if answer is not None:
            self._finish(answer)

    def eof_received(self) -> bool:
        self._end(None)
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._end(exc)

    def _end(self, exc: Exception | None) -> None:
        if self._reader is None:
            return
        answer = self._reader.at_end() if exc is None else None
        self._finish(answer or AnswerLost(f"the server closed the connection before answering"
                                          f"{f' ({exc})' if exc else ''}"))

    def _finish(self, outcome: Answer | Exception) -> None:
        waiter, self._waiter, self._reader = self._waiter, None, None
        if waiter is None or waiter.done():
            return
        if isinstance(outcome, Answer):
            self.idle_since = self._loop.time()  # as the server's idle clock starts, not when the caller resumes
            waiter.set_result(outcome)
        else:
            waiter.set_exception(outcome)

    def send(self, head: bytes, body: bytes, deadline: float, limit: int) -> asyncio.Future[Answer]:
        assert self.transport is not None and self._reader is None
        self._reader = AnswerReader(limit)
        self._waiter = self._loop.create_future()
        self.deadline = deadline
        self.transport.write(head + body)
        return self._waiter

    def expire(self, now: float, timeout_s: float) -> None:
        """Give up the answer in flight once its deadline has passed."""
        if self._reader is not None and now >= self.deadline:
            self._finish(AnswerLost(f"no answer within {timeout_s:.0f} s"))
            self.close()
    def ended(self) -> bool:
        """Whether the server closed this idle connection though the loop has not read that yet (a late loop):
        anything readable on an idle connection is its end (an idle connection is owed nothing)."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is None:
            return False
        poll = select.poll()
        poll.register(sock.fileno(), select.POLLIN)
        return bool(poll.poll(0))

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _tls_context() -> ssl.SSLContext:
    """Verify as httpx does by default: the bundle SSL_CERT_FILE / SSL_CERT_DIR name, else certifi's."""
    cafile, capath = os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR")
    if cafile or capath:
        return ssl.create_default_context(cafile=cafile, capath=capath)
    try:
        import certifi
    except ImportError:  # the system's store
        return ssl.create_default_context()
    return ssl.create_default_context(cafile=certifi.where())


class PostPool:
    """Keep-alive connections per origin; `post(url, body)` answers the status and body, or raises TransportError."""

    def __init__(self, headers: Mapping[str, str], timeout_s: float, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 keepalive_s: float = KEEPALIVE_EXPIRY_S) -> None:
        self._headers = dict(headers)
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._keepalive_s = keepalive_s
        self._idle: dict[Origin, list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._targets: dict[str, tuple[Origin, bytes]] = {}
        self._tls: ssl.SSLContext | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.connects = 0  # connections opened, over the pool's life

    def _target(self, url: str) -> tuple[Origin, bytes]:
        """The origin of a URL ending in its route ("…/generate") and the head of a POST there up to the body's
        length, made once per URL."""
        found = self._targets.get(url)
        if found is None:
            base, _, route = url.rpartition("/")
            origin = Origin.parse(base)
            found = self._targets[url] = (origin, post_head_start(origin, f"/{route}", self._headers))
        return found

    async def post(self, url: str, body: bytes, limit_bytes: int | None = None) -> Answer:
        """The answer's status and body; raises TransportError when none came, AnswerTooLarge past `limit_bytes`
        (default MAX_ANSWER_BYTES)."""
        origin, start = self._target(url)
        head = start + b"%d\r\n\r\n" % len(body)
        connection = self._idle_connection(origin) or await self._connect(origin)
        loop = asyncio.get_running_loop()
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = loop.create_task(self._sweep(), name="tokenmill-generate-timeouts")
        try:
            answer = await connection.send(head, body, loop.time() + self._timeout_s, limit_bytes or MAX_ANSWER_BYTES)
        except BaseException:
            self._drop(connection)
            raise
        if answer.keep_alive and not connection.closed:
            self._idle.setdefault(origin, []).append(connection)
        else:
            self._drop(connection)
        return answer

    async def _sweep(self) -> None:
        """Give up answers past their deadline: one timer for every request in flight, not one each (a timer per
        request cost more CPU than its answer's parsing)."""
        loop = asyncio.get_running_loop()
        every = min(1.0, self._timeout_s / 4)
        while True:
            await asyncio.sleep(every)
            now = loop.time()
            for connection in list(self._open):
                connection.expire(now, self._timeout_s)

    def _drop(self, connection: _Connection) -> None:
        connection.close()
        self._open.discard(connection)

    def _idle_connection(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        now = asyncio.get_running_loop().time()
        while idle:
            connection = idle.pop()  # the newest: the oldest expire first
            if not connection.closed and now - connection.idle_since < self._keepalive_s and not connection.ended():
                return connection
            connection.close()
            self._open.discard(connection)
        return None

    async def _connect(self, origin: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = None
        if origin.scheme == "https":
            if self._tls is None:
                self._tls = _tls_context()
            tls = self._tls
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, connection = await loop.create_connection(lambda: _Connection(loop), origin.host, origin.port,
                                                             ssl=tls)
        except TimeoutError:
            raise ConnectTimedOut(f"no connection to {origin.authority} within {self._connect_timeout_s:.0f} s") \
                from None
        except OSError as error:  # refused, unreachable, a name that does not resolve, a TLS failure
            raise ConnectFailed(f"{origin.authority}: {error}") from None
        self.connects += 1
        self._open.add(connection)
        return connection

    async def aclose(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        for connection in list(self._open):
            connection.close()
        self._open.clear()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports close

