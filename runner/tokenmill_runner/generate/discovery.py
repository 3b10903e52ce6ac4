"""What each --server URL is, an SGLang replica or an smg gateway in front of replicas, and its facts, over HTTP.

The facts are read from whichever route the endpoint serves (`facts/server_info.py` says which, release by release
and as smg answers). A gateway is recognised by its worker list (`GET /workers`, which no SGLang release serves); its
facts are its first worker's, counted over its healthy workers, and it is probed on `/readiness` when it is taken out
of rotation, since its `/health` answers 200 with no worker behind it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from ..facts.server_info import (
    GATEWAY_READINESS_ROUTE,
    GATEWAY_WORKERS_ROUTE,
    SERVER_INFO_ROUTES,
    FactsUnreadable,
    ServerFacts,
    gateway_workers,
    unreadable_message,
)
from .client import auth_headers

logger = logging.getLogger(__name__)

MAX_INFO_BYTES = 16 << 20  # a /server_info answer is a few KiB; a body past this is not one
REPLICA_HEALTH_ROUTE = "/health"


@dataclass(frozen=True)
class Endpoint:
    url: str
    info: dict[str, Any]  # the /server_info answer (through a gateway: its first worker's)
    facts: ServerFacts
    gateway: bool

    @property
    def probe_route(self) -> str:
        return GATEWAY_READINESS_ROUTE if self.gateway else REPLICA_HEALTH_ROUTE


async def discover(url: str, api_key: str | None = None, wait_s: float = 60.0, poll_s: float = 2.0,
                   timeout_s: float = 10.0, transport: httpx.AsyncBaseTransport | None = None) -> Endpoint:
    """The endpoint's facts. A 503 (a gateway whose workers are not healthy or not registered yet, a server still
    starting) is waited out for up to `wait_s`; anything else unreadable raises FactsUnreadable naming what was
    tried. `transport` replaces the network (tests feed each route's answer)."""
    base = url.rstrip("/")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    async with httpx.AsyncClient(timeout=timeout_s, headers=auth_headers(api_key), transport=transport) as http:
        while True:
            info, tried = await _server_info(http, base)
            if info is not None:
                break
            if not any(answer.startswith("HTTP 503") for _, answer in tried) or loop.time() >= deadline:
                raise FactsUnreadable(unreadable_message(base, tried))
            logger.info("%s: no facts yet (%s); waiting", base, "; ".join(f"{p}: {a}" for p, a in tried))
            await asyncio.sleep(poll_s)
        facts = ServerFacts.read(base, info)
        status, body = await _get(http, f"{base}{GATEWAY_WORKERS_ROUTE}")
        workers = gateway_workers(body) if status == 200 else None
    if workers is None:
        return Endpoint(base, info, facts, gateway=False)
    facts = facts.through_gateway(workers)
    logger.info("%s is a gateway with %d healthy workers (of %d listed); facts read through it", base,
                facts.workers, len(workers))
    return Endpoint(base, info, facts, gateway=True)


async def _server_info(http: httpx.AsyncClient, base: str) -> tuple[dict[str, Any] | None, list[tuple[str, str]]]:
    tried: list[tuple[str, str]] = []
    for route in SERVER_INFO_ROUTES:
        status, body = await _get(http, f"{base}{route}")
        if status == 200 and isinstance(body, dict):
            return body, tried
        tried.append((route, _describe(status, body)))
        if status != 404:  # the route exists and answered an error: the alias would answer the same
            break
    return None, tried


async def _get(http: httpx.AsyncClient, url: str) -> tuple[int | str, Any]:
    """The status and JSON body of a GET (the body None when it is not JSON or too large), or the transport
    error's name in place of the status."""
    try:
        async with http.stream("GET", url) as response:
            content = bytearray()
            async for chunk in response.aiter_bytes():
                content += chunk
                if len(content) > MAX_INFO_BYTES:
                    return response.status_code, None
    except httpx.TransportError as error:
        return type(error).__name__, None
    try:
        return response.status_code, orjson.loads(bytes(content))
    except orjson.JSONDecodeError:
        return response.status_code, None


def _describe(status: int | str, body: Any) -> str:
    if isinstance(status, str):
        return status
    detail = ""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):  # smg: {"error": {"code", "message"}}
        detail = f" ({body['error'].get('code')}: {body['error'].get('message')})"
    elif status == 200:
        detail = " (not a JSON object)"
    return f"HTTP {status}{detail}"
