"""HTTP/1.1 for /generate: the request head of a POST, and the answer read back from the bytes as they arrive. Pure.

Only what a POST to SGLang or smg needs (RFC 9112): a status line, headers, then a body framed by Content-Length,
by chunked transfer coding, or (no framing) by the end of the connection; 1xx interim answers are skipped. Both
the head and the body are bounded before they are held, whatever the server sends.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 * 1024
# A /generate answer holds the output ids (and the prompt's, echoed): ~7 bytes a token. 256 MiB is 30M tokens.
MAX_ANSWER_BYTES = 256 * 1024 * 1024
_NO_BODY = frozenset({204, 304})
_FRAMING = frozenset({"content-length", "transfer-encoding", "connection"})


class BadAnswer(Exception):
    """The server's bytes are not an HTTP/1.1 answer, or a larger one than this reader holds."""


class AnswerTooLarge(BadAnswer):
    """An answer larger than the reader's limit: asking again gets as large a one (a capture's size is known)."""


@dataclass(frozen=True)
class Origin:
    """Where a URL's requests go: scheme, host, port, and the path the server's routes hang under."""

    scheme: str
    host: str
    port: int
    path: str  # "" or "/prefix" (a gateway path), no trailing "/"

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http:// or https:// URL with a host")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


def post_head(origin: Origin, route: str, headers: Mapping[str, str], length: int) -> bytes:
    """The head of a POST of `length` body bytes to `route` (e.g. "/generate") of the origin."""
    return post_head_start(origin, route, headers) + b"%d\r\n\r\n" % length


def post_head_start(origin: Origin, route: str, headers: Mapping[str, str]) -> bytes:
    """Every byte of `post_head` up to the body's length, the same for every request to the route."""
    lines = [f"POST {origin.path}{route} HTTP/1.1", f"Host: {origin.authority}",
             *(f"{name}: {value}" for name, value in headers.items()), "Content-Length: "]
    return "\r\n".join(lines).encode("latin-1")


@dataclass(frozen=True)
class Answer:
    status: int
    content: bytes
    keep_alive: bool  # the connection may carry the next request


class AnswerReader:
    """Feed it the connection's bytes; it returns the answer once it is whole (and None before)."""

    def __init__(self, limit: int = MAX_ANSWER_BYTES) -> None:
        self._limit = limit
        self._buffer = bytearray()
        self._status = 0
        self._keep_alive = True
        self._length: int | None = None  # Content-Length
        self._chunked = False
        self._body = bytearray()  # a chunked body, decoded
        self._in_body = False
        self._chunk_left = -1  # bytes of the current chunk still to come (-1: a size line is next, -2: trailers)

    def feed(self, data: bytes) -> Answer | None:
        self._buffer += data
        if not self._in_body and not self._read_head():
            return None
        if self._chunked:
            return self._read_chunks()
        if self._length is not None:
            if len(self._buffer) > self._length:
                raise BadAnswer("more bytes than the answer's Content-Length (nothing was asked for them)")
            if len(self._buffer) == self._length:
                return Answer(self._status, bytes(self._buffer), self._keep_alive)
            return None
        if len(self._buffer) > self._limit:
            raise AnswerTooLarge(f"an answer over {self._limit} bytes")
        return None

    def at_end(self) -> Answer | None:
        """The connection ended: the answer, when its body runs to the end of the connection; else None."""
        if self._in_body and self._length is None and not self._chunked:
            return Answer(self._status, bytes(self._buffer), False)
        return None

    def _read_head(self) -> bool:
        while True:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > MAX_HEAD_BYTES:
                    raise BadAnswer(f"an answer head over {MAX_HEAD_BYTES} bytes")
                return False
            head = bytes(self._buffer[:end]).decode("latin-1")
            del self._buffer[:end + 4]
            status_line, *header_lines = head.split("\r\n")
            version, _, rest = status_line.partition(" ")
            code = rest[:3]
            if not version.startswith("HTTP/1.") or not code.isdigit():
                raise BadAnswer(f"not an HTTP/1.1 status line: {status_line[:80]!r}")
            status = int(code)
            if 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
                continue
            self._start_body(status, version, header_lines)
            return True

    def _start_body(self, status: int, version: str, header_lines: list[str]) -> None:
        fields: dict[str, str] = {}
        for line in header_lines:
            name, colon, value = line.partition(":")
            if not colon:
                raise BadAnswer(f"a header line without a colon: {line[:80]!r}")
            name = name.lower()
            if name not in _FRAMING:  # the others (date, server, content-type) say nothing about the framing
                continue
            fields[name] = f"{fields[name]}, {value.strip()}" if name in fields else value.strip()
        connection = fields.get("connection", "").lower()
        self._keep_alive = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
        self._status, self._in_body = status, True
        coding = fields.get("transfer-encoding", "").lower()
        if status in _NO_BODY:
            self._length = 0
        elif coding:
            if coding.rsplit(",", 1)[-1].strip() != "chunked":
                raise BadAnswer(f"a transfer coding this reader does not decode: {coding!r}")
            self._chunked = True
        elif "content-length" in fields:
            values = {value.strip() for value in fields["content-length"].split(",")}
            if len(values) != 1 or not (length := values.pop()).isdigit():
                raise BadAnswer(f"an invalid Content-Length: {fields['content-length']!r}")
            self._length = int(length)
            if self._length > self._limit:
                raise AnswerTooLarge(f"an answer of {self._length} bytes, over the {self._limit} this reader holds")
        else:
            self._keep_alive = False  # the body ends with the connection

    def _read_chunks(self) -> Answer | None:
        buffer = self._buffer
        while True:
            if self._chunk_left >= 0:
                if self._chunk_left > 0:
                    take = min(self._chunk_left, len(buffer))
                    self._body += buffer[:take]
                    del buffer[:take]
                    self._chunk_left -= take
                    if self._chunk_left:
                        return None
                if len(buffer) < 2:
                    return None
                if buffer[:2] != b"\r\n":
                    raise BadAnswer("a chunk not followed by CRLF")
                del buffer[:2]
                self._chunk_left = -1
            end = buffer.find(b"\r\n")
            if end < 0:
                if len(buffer) > MAX_HEAD_BYTES:
                    raise BadAnswer("a chunk size line too long")
                return None
            line = bytes(buffer[:end])
            del buffer[:end + 2]
            if self._chunk_left == -2:  # trailer fields, up to an empty line
                if line:
                    continue
                if buffer:
                    raise BadAnswer("more bytes after the chunked answer (nothing was asked for them)")
                return Answer(self._status, bytes(self._body), self._keep_alive)
            size = line.split(b";", 1)[0].strip()
            try:
                self._chunk_left = int(size, 16)
            except ValueError:
                raise BadAnswer(f"an invalid chunk size: {size[:20]!r}") from None
            if self._chunk_left < 0:
                raise BadAnswer(f"an invalid chunk size: {size[:20]!r}")
            if len(self._body) + self._chunk_left > self._limit:
                raise AnswerTooLarge(f"an answer over {self._limit} bytes")
            if self._chunk_left == 0:
                self._chunk_left = -2
