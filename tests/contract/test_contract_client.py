"""The contract suite over HTTP: a small aiohttp server replays each answer of each supported release (answers.py)
byte for byte, with its status and content type, and the real client (GenerateClient) talks to it.

What the client must do with each kind of answer:
- a generation: return it;
- final (the server refused this input): record it after one request;
- sample (NaN, an abort): retry, and record it with its reason when it persists (maxAttempts);
- overload / replica (503, 429, 5xx): retry; when the only replica keeps answering that, take it out, probe it, and
  wait without writing the sample off until the outage budget is spent (ServersUnavailable);
- fatal (401): stop the run.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Iterator

import orjson
import pytest
from aiohttp import web

from tokenmill_runner.facts.releases import release
from tokenmill_runner.generate.client import GenerateClient, RetryPolicy, ServerFatalError, ServersUnavailable
from tokenmill_runner.generate.replica_health import HealthPolicy
from tokenmill_runner.generate.results import Generation, GenerationFailure

from .answers import CASES, EOS, LEGACY, PROMPT, VOCAB, Answer, case_id, ok

ALL = CASES + LEGACY
GOOD = orjson.dumps(ok(release("0.5.23"), [10, EOS],
                       {"type": "stop", "matched": EOS}))
FAST_RETRY = RetryPolicy(max_attempts=2, base_delay_s=0.001, max_delay_s=0.01)
FAST_HEALTH = HealthPolicy(open_after=2, probe_first_s=0.02, probe_max_s=0.05, outage_budget_s=0.15)


class Replay:
    """Answers /case/<i>/generate with answer i; /case/<i>/then-ok/generate with answer i once, then a good one."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/case/{index}/generate", self.generate)
        app.router.add_post("/case/{index}/then-ok/generate", self.generate)
        app.router.add_get("/case/{index}/health", self.health)
        app.router.add_get("/case/{index}/then-ok/health", self.health)
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        host, port = runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        self._ready.set()
        self._loop.run_forever()

    def start(self) -> Replay:
        self._thread.start()
        self._ready.wait()
        return self

    async def generate(self, request: web.Request) -> web.Response:
        self.calls[request.path] += 1
        answer = ALL[int(request.match_info["index"])][1]
        if "then-ok" in request.path and self.calls[request.path] > 1:
            return web.Response(status=200, body=GOOD, content_type="application/json")
        body = answer.body.encode() if isinstance(answer.body, str) else orjson.dumps(answer.body)
        return web.Response(status=answer.status, body=body, content_type=answer.content_type)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)


@pytest.fixture(scope="module")
def replay() -> Iterator[Replay]:
    yield Replay().start()


def client(url: str) -> GenerateClient:
    return GenerateClient([url], concurrency=4, retry=FAST_RETRY, health=FAST_HEALTH, seed=1, vocab_size=VOCAB)


async def send(url: str) -> Generation | GenerationFailure:
    generate = client(url)
    try:
        return await generate.generate(PROMPT, {"max_new_tokens": 16})
    finally:
        await generate.aclose()


@pytest.mark.parametrize("index", range(len(ALL)), ids=[case_id(case) for case in ALL])
async def test_the_client_over_http(replay: Replay, index: int) -> None:
    answer: Answer = ALL[index][1]
    base = f"{replay.url}/case/{index}"
    if answer.expect == "generation":
        result = await send(base)
        assert isinstance(result, Generation) and result.attempts == 1
        for name, value in answer.fields.items():
            assert getattr(result, name) == value, name
    elif answer.expect == "final":
        result = await send(base)
        assert isinstance(result, GenerationFailure) and (result.reason, result.attempts) == (answer.reason, 1)
        assert replay.calls[f"/case/{index}/generate"] == 1
    elif answer.expect == "fatal":
        with pytest.raises(ServerFatalError, match="API key"):
            await send(base)
    elif answer.expect == "sample":
        given_up = await send(base)
        assert isinstance(given_up, GenerationFailure) and given_up.reason == answer.reason
        assert given_up.attempts == FAST_RETRY.max_attempts == replay.calls[f"/case/{index}/generate"]
        retried = await send(f"{base}/then-ok")
        assert isinstance(retried, Generation) and retried.attempts == 2
    else:  # overload, replica: the server's trouble, never the sample's
        retried = await send(f"{base}/then-ok")
        assert isinstance(retried, Generation) and retried.attempts == 2
        with pytest.raises(ServersUnavailable, match="outage budget"):
            await send(base)
