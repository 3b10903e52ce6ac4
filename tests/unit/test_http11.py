"""The runner's HTTP/1.1 for /generate (issue 44: a lean client in place of httpx): answers framed every way RFC 9112
allows, fed in pieces as a socket delivers them, bounded; and the transport over real sockets, whose failures are
told apart as the client's fault classes need (nothing listening, or an answer lost after the request was sent)."""

from __future__ import annotations

import asyncio

import pytest

from tokenmill_runner.generate.http11 import AnswerReader, BadAnswer, Origin, post_head
from tokenmill_runner.generate.transport import AnswerLost, AnswerTooLarge, ConnectFailed, PostPool

BODY = b'{"output_ids":[1,2,3],"meta_info":{}}'


def feed_in_pieces(raw: bytes, size: int, limit: int | None = None):
    reader = AnswerReader() if limit is None else AnswerReader(limit)
    answers = [reader.feed(raw[i:i + size]) for i in range(0, len(raw), size)]
    assert all(answer is None for answer in answers[:-1]), "nothing is answered before the last byte"
    return answers[-1], reader


@pytest.mark.parametrize("size", [1, 7, 4096])
def test_answers_framed_by_length_by_chunks_or_after_an_interim_answer_read_whole_from_any_pieces(size: int) -> None:
    plain = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
    answer, _ = feed_in_pieces(plain, size)
    assert (answer.status, answer.content, answer.keep_alive) == (200, BODY, True)
    chunked = (b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
               b"5;ext=1\r\n" + BODY[:5] + b"\r\n" + b"%x\r\n" % (len(BODY) - 5) + BODY[5:] + b"\r\n0\r\nx-t: 1\r\n\r\n")
    answer, _ = feed_in_pieces(chunked, size)
    assert (answer.status, answer.content, answer.keep_alive) == (503, BODY, False)
    interim = b"HTTP/1.1 100 Continue\r\n\r\n" + plain
    answer, _ = feed_in_pieces(interim, size)
    assert (answer.status, answer.content) == (200, BODY)


def test_an_answer_without_framing_ends_with_the_connection_and_an_http10_one_is_not_kept() -> None:
    reader = AnswerReader()
    assert reader.feed(b"HTTP/1.0 200 OK\r\n\r\n" + BODY) is None
    answer = reader.at_end()
    assert (answer.content, answer.keep_alive) == (BODY, False)
    cut = AnswerReader()
    assert cut.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n{") is None
    assert cut.at_end() is None, "a body cut short is no answer"


@pytest.mark.parametrize("raw", [
    b"SSH-2.0-OpenSSH\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}extra",
    b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3e8\r\n",
])
def test_what_is_not_an_answer_or_is_larger_than_allowed_is_refused_before_it_is_held(raw: bytes) -> None:
    with pytest.raises(BadAnswer):
        AnswerReader(limit=100).feed(raw)


def test_a_head_that_never_ends_is_refused_at_its_bound() -> None:
    reader = AnswerReader()
    with pytest.raises(BadAnswer):
        for _ in range(100):
            reader.feed(b"x-filler: " + b"a" * 1000 + b"\r\n")


def test_the_request_head_names_the_gateway_path_and_the_host_as_http_wants() -> None:
    origin = Origin.parse("http://[::1]:8080/case/3")
    head = post_head(origin, "/generate", {"Authorization": "Bearer k"}, 12)
    assert head == (b"POST /case/3/generate HTTP/1.1\r\nHost: [::1]:8080\r\nAuthorization: Bearer k\r\n"
                    b"Content-Length: 12\r\n\r\n")
    assert Origin.parse("https://h/").authority == "h" and Origin.parse("https://h").port == 443
    with pytest.raises(ValueError):
        Origin.parse("ftp://h")


def test_the_pool_reuses_a_connection_gives_up_a_late_answer_and_tells_nothing_listening_from_an_answer_lost() -> None:
    async def main() -> None:
        connections = []

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            connections.append(writer)
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                body = await reader.readexactly(length)
                if body == b"drop":  # the request arrived; the connection breaks before any answer
                    writer.close()
                    return
                if body == b"hang":  # never answered
                    await asyncio.sleep(3600)
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                await writer.drain()
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = PostPool({"Content-Type": "application/json"}, timeout_s=0.2)
        try:
            answers = [await pool.post(f"http://127.0.0.1:{port}/generate", b"%d" % i) for i in range(3)]
            assert [a.content for a in answers] == [b"0", b"1", b"2"] and pool.connects == 1 == len(connections)
            # A capture's answer past the size it can be: refused as the caller's limit, not a lost answer (the
            # client gives it up at once instead of retrying a replica for it); the pool goes on.
            with pytest.raises(AnswerTooLarge):
                await pool.post(f"http://127.0.0.1:{port}/generate", b"too long", limit_bytes=4)
            assert (await pool.post(f"http://127.0.0.1:{port}/generate", b"fits", limit_bytes=4)).content == b"fits"
            with pytest.raises(AnswerLost) as lost:
                await pool.post(f"http://127.0.0.1:{port}/generate", b"drop")
            assert not lost.value.connect
            with pytest.raises(AnswerLost, match="no answer within"):
                await pool.post(f"http://127.0.0.1:{port}/generate", b"hang")
            server.close()
            for writer in connections:
                writer.close()
            await server.wait_closed()
            with pytest.raises(ConnectFailed) as refused:
                await pool.post(f"http://127.0.0.1:{port}/generate", b"x")
            assert refused.value.connect
        finally:
            await pool.aclose()

    asyncio.run(main())
