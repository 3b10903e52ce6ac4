"""A server a tenant controls, for the tests of the operator's read bounds (tests/unit/test_operator_read_bounds.py,
tests/e2e/test_adversarial.py): it answers each request as the test says (a trickle, a redirect, a body) and
records what it got and whether the operator closed a connection it was trickling into."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable


class Endpoint:
    """A TCP server a tenant controls; `answer(conn, request_number)` plays each request of a connection. It
    records the requests it got and when the operator closed a connection it was trickling into."""

    def __init__(self, answer: Callable[[socket.socket, int], None]) -> None:
        self.answer = answer
        self.requests: list[bytes] = []
        self.closed = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        with conn:
            number = 0
            try:
                while request := conn.recv(65536):
                    self.requests.append(request)
                    self.answer(conn, number)
                    number += 1
            except OSError:
                self.closed.set()

    def close(self) -> None:
        self.listener.close()


def trickle(conn: socket.socket, seconds: float = 20.0, every: float = 0.05) -> None:
    """200, a large Content-Length, then a byte every `every` seconds for `seconds` (B3's endpoint sent one every
    5 s)."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n")
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        conn.sendall(b"x")
        time.sleep(every)
    conn.close()


def answered(body: bytes, status: str = "200 OK", headers: str = "") -> Callable[[socket.socket, int], None]:
    def answer(conn: socket.socket, _: int) -> None:
        conn.sendall(f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{headers}\r\n".encode() + body)
    return answer
