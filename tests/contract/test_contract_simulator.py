"""The contract suite against the simulator configured as each supported release: the real client over HTTP meets
what that release answers (the simulator's per-release behaviour is tested against the releases' source in
tests/unit/test_sim_protocol.py and tests/integration/test_simulator_http.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tokenmill_runner.facts.releases import SUPPORTED_RELEASES, release
from tokenmill_runner.generate.client import GenerateClient, RetryPolicy, ServerFatalError, ServersUnavailable
from tokenmill_runner.generate.replica_health import HealthPolicy
from tokenmill_runner.generate.results import Generation, GenerationFailure
from tokenmill_sim.config import SimConfig
from tokenmill_sim.server import SimServer

RETRY = RetryPolicy(max_attempts=2, base_delay_s=0.001, max_delay_s=0.01)
HEALTH = HealthPolicy(open_after=2, probe_first_s=0.02, probe_max_s=0.05, outage_budget_s=0.15)
CONTEXT = 4096
PROMPT = [5, 40, 41, 42, 43, 8, 14]


@pytest.fixture(scope="module", params=SUPPORTED_RELEASES)
def version(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def server(demo_model: Path, version: str, request: pytest.FixtureRequest) -> Iterator[SimServer]:
    overrides: dict[str, Any] = getattr(request, "param", {})
    config = SimConfig(model_path=str(demo_model), sglang_version=version, time_scale=5000.0,
                       context_length=CONTEXT, **overrides)
    with SimServer(config) as sim:
        yield sim


async def generate(url: str, sampling: dict[str, Any], api_key: str | None = None) -> Generation | GenerationFailure:
    client = GenerateClient([url], api_key=api_key, retry=RETRY, health=HEALTH, seed=2, vocab_size=1131)
    try:
        return await client.generate(PROMPT, sampling)
    finally:
        await client.aclose()


async def test_a_generation_with_the_release_s_meta_info(server: SimServer, version: str) -> None:
    result = await generate(server.url, {"max_new_tokens": 300})
    assert isinstance(result, Generation) and result.attempts == 1
    assert len(result.output_ids) == result.completion_tokens and result.retractions == 0


@pytest.mark.parametrize("server", [{"fault_nan_rate": 1.0}], indirect=True)
async def test_nan_answers_are_given_up_as_nan_output(server: SimServer) -> None:
    result = await generate(server.url, {"max_new_tokens": 300})
    assert isinstance(result, GenerationFailure) and result.reason == "nan_output" and result.attempts == 2


async def test_an_unknown_sampling_key(server: SimServer, version: str) -> None:
    if release(version).unknown_sampling_key_status == 400:  # the contract gate: refused, recorded
        result = await generate(server.url, {"max_tokens": 300})
        assert isinstance(result, GenerationFailure) and result.reason == "server_rejected"
        assert "unknown field `max_tokens`" in result.message
    else:  # a 500 for every request: the server is broken, the sample is not written off
        with pytest.raises(ServersUnavailable):
            await generate(server.url, {"max_tokens": 300})


async def test_prompt_plus_max_new_tokens_equal_to_the_context(server: SimServer, version: str) -> None:
    result = await generate(server.url, {"max_new_tokens": CONTEXT - len(PROMPT), "ignore_eos": True})
    if release(version).context_rule == ">=":
        assert isinstance(result, GenerationFailure) and result.reason == "server_rejected"
        assert "Requested token count exceeds" in result.message
    else:  # accepted, then silently cut by the scheduler to max_req_len - prompt - 1 = context - prompt - 2
        assert isinstance(result, Generation) and result.finish_reason == "length"
        assert result.completion_tokens == CONTEXT - len(PROMPT) - 2


@pytest.mark.parametrize("server", [{"fault_503_rate": 1.0}], indirect=True)
async def test_a_server_that_only_answers_503(server: SimServer) -> None:
    with pytest.raises(ServersUnavailable, match="HTTP 503: The request queue is full"):
        await generate(server.url, {"max_new_tokens": 10})


@pytest.mark.parametrize("server", [{"api_key": "right"}], indirect=True)
async def test_a_wrong_api_key_stops_the_run(server: SimServer) -> None:
    with pytest.raises(ServerFatalError, match="HTTP 401: Unauthorized"):
        await generate(server.url, {"max_new_tokens": 10}, api_key="wrong")
    assert isinstance(await generate(server.url, {"max_new_tokens": 10}, api_key="right"), Generation)
