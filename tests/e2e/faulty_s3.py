"""A fault-injecting HTTP proxy in front of the test S3 server (moto), for the operator's fault tests.

The operator is pointed at the proxy (spec.output.endpoint); the runner pods the tests play talk to moto directly,
so only the operator's reads of run.json, the commit markers and the model files meet the faults. Modes, switched
while it runs: `pass` (forward), `error` (answer 503 SlowDown with S3's XML error body, as S3 does when it throttles),
`reset` (close the connection with a TCP reset before any answer), `slow` (forward after `delay` seconds).

(The runner-side fault tests get a fuller proxy under tests/faults/; this one is the operator's small one.)
"""

from __future__ import annotations

import http.client
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


class FaultyS3:
    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.mode = "pass"
        self.delay = 0.0
        self.lock = threading.Lock()
        self.in_flight = 0
        self.seen: dict[str, int] = {}  # requests met per mode
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def set(self, mode: str, delay: float = 0.0) -> None:
        assert mode in ("pass", "error", "reset", "slow"), mode
        self.mode, self.delay = mode, delay

    def wait_for_requests(self, mode: str, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.seen.get(mode, 0) < count:
            assert time.monotonic() < deadline, f"the operator sent fewer than {count} requests in mode {mode}"
            time.sleep(0.1)

    def wait_in_flight(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.in_flight == 0:
            assert time.monotonic() < deadline, "no request in flight through the proxy"
            time.sleep(0.02)

    def __enter__(self) -> FaultyS3:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _serve(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                mode, delay = proxy.mode, proxy.delay
                with proxy.lock:
                    proxy.seen[mode] = proxy.seen.get(mode, 0) + 1
                    proxy.in_flight += 1
                try:
                    if mode == "reset":
                        # SO_LINGER 0: close() sends RST, the client sees "connection reset by peer".
                        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        self.close_connection = True
                        return
                    if mode == "error":
                        self._answer(503, {"Content-Type": "application/xml", "Retry-After": "1"}, SLOW_DOWN)
                        return
                    if mode == "slow":
                        time.sleep(delay)
                    self._forward(body)
                finally:
                    with proxy.lock:
                        proxy.in_flight -= 1

            def _forward(self, body: bytes) -> None:
                upstream = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                    upstream.request(self.command, self.path, body=body or None, headers=headers)
                    response = upstream.getresponse()
                    data = response.read()
                    # A HEAD answer's Content-Length is the object's size, not the (empty) body's: keep it.
                    kept = {k: v for k, v in response.getheaders() if k.lower() not in HOP_BY_HOP
                            and (k.lower() != "content-length" or self.command == "HEAD")}
                    self._answer(response.status, kept, data)
                finally:
                    upstream.close()

            def _answer(self, status: int, headers: dict[str, str], data: bytes) -> None:
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                if not any(key.lower() == "content-length" for key in headers):
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _serve

        return Handler


@contextmanager
def faulty_s3(upstream: str) -> Iterator[FaultyS3]:
    with FaultyS3(upstream) as proxy:
        yield proxy
