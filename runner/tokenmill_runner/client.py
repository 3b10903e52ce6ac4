"""SGLang's native /generate over async httpx: ids in, ids out, retried where a retry can help.

Several server URLs are used at once; each request goes to the server with the fewest requests outstanding from
this client (ties rotate), which keeps replicas evenly loaded even when outputs vary 100x in length.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from .results import Generation, GenerationFailure, Retry, parse_generation

logger = logging.getLogger(__name__)

RETRYABLE_STATUS = {429, 500, 502, 503, 504}
FATAL_STATUS = {401, 403, 404}
# httpcore's connection pool does O(pool size) work per request, so hundreds of connections in one pool cost
# quadratic CPU; requests are spread over several small pools ("lanes") instead.
LANE_CONNECTIONS = 16
# SGLang (uvicorn) closes idle keep-alive connections after 5 s; drop them first, or a request sent on a
# connection the server is closing fails with a ReadError.
KEEPALIVE_EXPIRY_S = 4.0


class ServerFatalError(RuntimeError):
    """A server answer that no retry or other sample can fix (wrong API key, wrong URL): stop the run."""


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 6
    base_delay_s: float = 0.5
    max_delay_s: float = 30.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        # Full jitter: spreads retries of many requests that failed together (a server restart) over time.
        return rng.uniform(0, min(self.max_delay_s, self.base_delay_s * 2 ** (attempt - 1)))


def _error_message(response: httpx.Response) -> str:
    try:
        body = orjson.loads(response.content)
        if isinstance(body, dict):
            error = body.get("error")
            if isinstance(error, dict) and error.get("message"):
                return str(error["message"])
            if body.get("message"):
                return str(body["message"])
    except orjson.JSONDecodeError:
        pass
    return response.text[:300] or response.reason_phrase


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class GenerateClient:
    def __init__(self, servers: Sequence[str], *, api_key: str | None = None, concurrency: int = 64,
                 retry: RetryPolicy | None = None, timeout_s: float = 3600.0, seed: int | None = None) -> None:
        if not servers:
            raise ValueError("at least one server URL is needed")
        self.servers = [url.rstrip("/") for url in servers]
        self.outstanding = {url: 0 for url in self.servers}
        self.retry = retry or RetryPolicy()
        self.retries = 0  # attempts beyond the first, over the whole run
        self._rng = random.Random(seed)
        self._turn = 0
        headers = {"Content-Type": "application/json", **auth_headers(api_key)}
        lanes = max(1, -(-concurrency // LANE_CONNECTIONS))
        per_lane = -(-concurrency // lanes) + 4
        limits = httpx.Limits(max_connections=per_lane, max_keepalive_connections=per_lane,
                              keepalive_expiry=KEEPALIVE_EXPIRY_S)
        timeout = httpx.Timeout(timeout_s, connect=30.0, pool=None)
        self._lanes = [httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) for _ in range(lanes)]
        self._lane_load = [0] * lanes

    async def aclose(self) -> None:
        for lane in self._lanes:
            await lane.aclose()

    def pick_server(self) -> str:
        least = min(self.outstanding.values())
        candidates = [url for url in self.servers if self.outstanding[url] == least]
        self._turn += 1
        return candidates[self._turn % len(candidates)]

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any]) -> Generation | GenerationFailure:
        body = orjson.dumps({"input_ids": input_ids, "sampling_params": sampling_params})
        last_error = "no attempt made"
        for attempt in range(1, self.retry.max_attempts + 1):
            if attempt > 1:
                self.retries += 1
                await asyncio.sleep(self.retry.delay(attempt - 1, self._rng))
            server = self.pick_server()
            self.outstanding[server] += 1
            try:
                return await self._attempt(server, body, attempt)
            except Retry as retry:
                last_error = retry.message
                logger.debug("attempt %d failed: %s", attempt, last_error)
            finally:
                self.outstanding[server] -= 1
        return GenerationFailure(
            "retries_exhausted", f"gave up after {self.retry.max_attempts} attempts; last error: {last_error}",
            self.retry.max_attempts,
        )

    async def _post(self, url: str, body: bytes) -> httpx.Response:
        lane = self._lane_load.index(min(self._lane_load))
        self._lane_load[lane] += 1
        try:
            return await self._lanes[lane].post(url, content=body)
        finally:
            self._lane_load[lane] -= 1

    async def _attempt(self, server: str, body: bytes, attempt: int) -> Generation | GenerationFailure:
        try:
            response = await self._post(f"{server}/generate", body)
        except httpx.TransportError as error:
            raise Retry(f"{server}: {type(error).__name__}: {error or 'connection failed'}") from None
        if response.status_code == 200:
            try:
                payload = orjson.loads(response.content)
            except orjson.JSONDecodeError:
                raise Retry(f"{server}: /generate answered 200 with a body that is not JSON") from None
            return parse_generation(payload, server, attempt)
        message = _error_message(response)
        if response.status_code in RETRYABLE_STATUS:
            raise Retry(f"{server}: HTTP {response.status_code}: {message}")
        if response.status_code in FATAL_STATUS:
            hint = " (check the server API key)" if response.status_code in (401, 403) else ""
            raise ServerFatalError(f"{server}/generate: HTTP {response.status_code}: {message}{hint}")
        return GenerationFailure("server_rejected", f"{server}: HTTP {response.status_code}: {message}", attempt)


async def get_json(url: str, path: str, api_key: str | None = None, timeout_s: float = 10.0) -> Any:
    async with httpx.AsyncClient(timeout=timeout_s, headers=auth_headers(api_key)) as http:
        response = await http.get(f"{url.rstrip('/')}{path}")
        response.raise_for_status()
        return response.json()


async def wait_until_healthy(url: str, timeout_s: float, api_key: str | None = None,
                             poll_s: float = 2.0) -> None:
    """Poll /health until it answers 200 (SGLang answers 503 until its warm-up generation is done)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last = "no answer yet"
    async with httpx.AsyncClient(timeout=30.0, headers=auth_headers(api_key)) as http:
        while loop.time() < deadline:
            try:
                response = await http.get(f"{url.rstrip('/')}/health")
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code}"
            except httpx.TransportError as error:
                last = f"{type(error).__name__}"
            logger.info("waiting for %s to become healthy (%s)", url, last)
            await asyncio.sleep(poll_s)
    raise TimeoutError(f"{url} did not become healthy within {timeout_s:.0f}s (last: {last})")
