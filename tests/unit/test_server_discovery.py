"""Fact discovery on each endpoint's routes, with no server: each route's answer is fed in (httpx's MockTransport
stands in for the network only; the answers are the shapes the releases and smg 1.13.0 give).

Routes: every supported SGLang release serves /server_info and its deprecated alias /get_server_info (0.5.9
entrypoints/http_server.py:583,593; 0.5.16 :733,743; 0.5.23 :853,863) and no /workers; smg 1.13.0 serves only
/get_server_info and /get_model_info, forwarded to its first worker (model_gateway/src/server.rs public_routes,
routers/http/router.rs proxy_get_request), GET /workers (its worker list), /health (its own liveness, always 200) and
/readiness (503 "insufficient healthy workers" while none is healthy)."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from tokenmill_runner.facts.server_info import FactsUnreadable, gateway_workers
from tokenmill_runner.generate.discovery import discover
from tokenmill_runner.generate.results import Fault, classify_error

URL = "http://gw.test:30000"


def server_info(version: str, slots: int = 256, pool: int = 400_000, context: int | None = 32768) -> dict[str, Any]:
    """A /server_info answer's fields tokenmill reads, as the release shapes them (server_info.py's docstring)."""
    return {"version": version, "context_length": context, "max_total_num_tokens": pool,
            "max_req_input_len": 32762, "page_size": 1, "dp_size": 1, "max_running_requests": None,
            "internal_states": [{"effective_max_running_requests_per_dp": slots,
                                 "memory_usage": {"token_capacity": pool}}]}


def smg_workers(*versions: str, healthy: tuple[bool, ...] | None = None) -> dict[str, Any]:
    """smg 1.13.0's GET /workers answer (as it answered in front of two `tokenmill sim-server` replicas; trimmed)."""
    healthy = healthy or (True,) * len(versions)
    return {"workers": [{
        "id": f"w{i}", "url": f"http://10.0.0.{i}:30000", "worker_type": "regular", "connection_mode": "http",
        "runtime_type": "sglang", "is_healthy": up, "status": "ready" if up else "not_ready",
        "labels": {"version": version, "max_running_requests": "256", "max_total_tokens": "400000", "dp_size": "1"},
        "models": [{"id": "m", "context_length": 400000}]} for i, (version, up) in enumerate(zip(versions, healthy, strict=True))],
        "total": len(versions), "stats": {"prefill_count": 0, "decode_count": 0, "regular_count": len(versions)}}


def smg_error(code: str, message: str) -> dict[str, Any]:
    """smg's error body (routers/error.rs create_error)."""
    return {"error": {"type": "server_error", "code": code, "message": message, "param": None}}


Answer = tuple[int, Any]


def routes(answers: dict[str, Answer | list[Answer]], seen: list[str] | None = None) -> httpx.MockTransport:
    """A transport answering each path as given (a list: one answer per call, the last one repeated); 404 else."""
    calls: dict[str, int] = {}

    def handle(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if seen is not None:
            seen.append(path)
        answer = answers.get(path, (404, {"detail": "Not Found"}))
        if isinstance(answer, list):
            answer = answer[min(calls.get(path, 0), len(answer) - 1)]
            calls[path] = calls.get(path, 0) + 1
        status, body = answer
        return httpx.Response(status, json=body)

    return httpx.MockTransport(handle)


SGLANG = ["0.5.9", "0.5.16", "0.5.23"]


@pytest.mark.parametrize("version", SGLANG)
async def test_a_replica_is_read_from_server_info_and_probed_on_health(version: str) -> None:
    seen: list[str] = []
    info = server_info(version)
    endpoint = await discover(URL, transport=routes({"/server_info": (200, info), "/get_server_info": (200, info)},
                                                    seen))
    assert not endpoint.gateway and endpoint.probe_route == "/health"
    assert endpoint.facts.version == version and endpoint.facts.slots == 256
    assert endpoint.facts.release is not None and endpoint.facts.release.version == version
    assert seen == ["/server_info", "/workers"]  # the current name first; /workers is 404 on a replica


@pytest.mark.parametrize("version", SGLANG)
async def test_smg_is_read_through_get_server_info_and_counted_over_its_healthy_workers(version: str) -> None:
    seen: list[str] = []
    transport = routes({"/get_server_info": (200, server_info(version)),
                        "/workers": (200, smg_workers(version, version, version, healthy=(True, True, False)))}, seen)
    endpoint = await discover(URL, transport=transport)
    assert endpoint.gateway and endpoint.probe_route == "/readiness"
    assert seen == ["/server_info", "/get_server_info", "/workers"]
    facts = endpoint.facts
    assert facts.workers == 2  # the unhealthy third takes no requests
    assert facts.slots == 2 * 256 and facts.kv_pools == (400_000, 400_000)
    assert facts.context_length == 32768  # the worker's, not smg's model card (400000 here: its KV pool)
    assert facts.release is not None and facts.release.version == version


async def test_smg_in_front_of_mixed_releases_assumes_the_strictest_rules() -> None:
    transport = routes({"/get_server_info": (200, server_info("0.5.23")),
                        "/workers": (200, smg_workers("0.5.23", "0.5.9"))})
    facts = (await discover(URL, transport=transport)).facts
    assert facts.release is None and facts.version is None and facts.workers == 2


async def test_smg_with_no_worker_yet_is_waited_for() -> None:
    no_worker = (503, smg_error("no_workers", "No workers are available"))
    transport = routes({"/get_server_info": [no_worker, no_worker, (200, server_info("0.5.23"))],
                        "/workers": (200, smg_workers("0.5.23"))})
    endpoint = await discover(URL, wait_s=60, poll_s=0.001, transport=transport)
    assert endpoint.gateway and endpoint.facts.slots == 256


async def test_smg_with_no_worker_past_the_wait_names_what_to_do() -> None:
    transport = routes({"/get_server_info": (503, smg_error("no_workers", "No workers are available"))})
    with pytest.raises(FactsUnreadable) as caught:
        await discover(URL, wait_s=0.01, poll_s=0.001, transport=transport)
    message = str(caught.value)
    assert f"GET {URL}/server_info: HTTP 404" in message
    assert f"GET {URL}/get_server_info: HTTP 503 (no_workers: No workers are available)" in message
    assert "GET /workers" in message and "--server-wait" in message


async def test_an_endpoint_without_either_route_names_both_and_how_to_point_at_sglang_or_smg() -> None:
    with pytest.raises(FactsUnreadable) as caught:
        await discover(URL, transport=routes({}))
    message = str(caught.value)
    assert message.startswith(f"cannot read the server's facts from {URL}:")
    assert f"{URL}/server_info: HTTP 404" in message and f"{URL}/get_server_info: HTTP 404" in message
    assert "smg launch --worker-urls" in message and "sglang.launch_server" in message


async def test_a_wrong_api_key_is_named_as_such_and_not_retried_on_the_alias() -> None:
    seen: list[str] = []
    with pytest.raises(FactsUnreadable, match="TOKENMILL_API_KEY"):
        await discover(URL, transport=routes({"/server_info": (401, {"error": "Unauthorized"})}, seen))
    assert seen == ["/server_info"]


def test_a_body_that_is_not_smgs_worker_list_is_no_gateway() -> None:
    assert gateway_workers({"detail": "Not Found"}) is None
    assert gateway_workers([1, 2]) is None
    assert gateway_workers({"workers": [{"url": 3}, "x"]}) == []


GATEWAY_NO_WORKER: list[tuple[int, str, str]] = [
    # every circuit breaker open or every worker unhealthy (router.rs route_typed_request)
    (503, "no_available_workers", "All workers are unavailable (circuit breaker open or unhealthy)"),
    (503, "no_workers", "No workers are available"),
    # the registry emptied (workers removed): smg's "model not found" is not a wrong URL
    (404, "model_not_found", "No worker available for model 'unknown'"),
    # the chosen worker refused the connection before smg saw it unhealthy (router.rs convert_reqwest_error)
    (500, "call_upstream_connection_failed", "error sending request for url (http://10.0.0.1:30000/generate)"),
]


@pytest.mark.parametrize(("status", "code", "message"), GATEWAY_NO_WORKER)
def test_a_gateway_with_no_live_worker_is_an_outage_not_the_samples_failure(status: int, code: str,
                                                                              message: str) -> None:
    failed = classify_error(status, orjson.dumps(smg_error(code, message)), URL)
    assert failed.fault is Fault.OVERLOAD  # never counted against the sample; the outage budget bounds it
    assert code in failed.message and message in failed.message


@pytest.mark.parametrize(("status", "body", "fault"), [
    (404, b'{"detail":"Not Found"}', Fault.FATAL),  # a wrong URL still stops the run
    (500, b'{"error":{"message":"boom"}}', Fault.REPLICA),  # SGLang's own error: no code
    (400, b'{"object":"error","message":"bad","type":"BadRequest","param":null,"code":400}', Fault.FINAL),
    (500, b"Internal Server Error", Fault.REPLICA),
])
def test_sglangs_own_error_answers_keep_their_meaning(status: int, body: bytes, fault: Fault) -> None:
    assert classify_error(status, body, URL).fault is fault
