"""Every sampling field the spec can produce, in the body the client sends, through each supported release's own
request schema read from its wheel (tests/contract/sglang_wheels.py).

From 0.5.22 a JSON contract gate runs before /generate (0.5.22 entrypoints/http_server.py:921, 0.5.23 :937-939) and
answers 400 to an unknown sampling_params key or a wrong type (0.5.23 sglang/api/v1/api_types.py: serde's messages):
the body goes through that release's generated decoder itself (`api_types.GenerateRequest.from_json_value`). Before
0.5.22 the route builds `GenerateReqInput` (managers/io_struct.py) and then `SamplingParams(**sampling_params)`
(sampling/sampling_params.py), where an unknown key is a TypeError and HTTP 500: every key sent must be one they
take. The body is built as for a server of that release (facts/server_info.client_options): return_prompt_token_ids
only from 0.5.13.post1, routed_dp_rank from 0.5.10.post1 for a server with several data-parallel schedulers.
"""

from __future__ import annotations

from typing import Any

import pytest

from tokenmill_runner.facts.releases import SUPPORTED_RELEASES, release, version_key
from tokenmill_runner.facts.server_info import ServerFacts, client_options, seeds_accepted
from tokenmill_runner.generate.client import GenerateClient
from tokenmill_runner.spec.resource import DefaultSamplingSpec, SamplingSpec

from .sglang_wheels import api_types, keyword_fields

URL = "http://replica"
SAMPLING = "sglang/srt/sampling/sampling_params.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"

# Every field of SamplingSpec set, at the edges the spec allows.
EVERY_FIELD = SamplingSpec(max_new_tokens=1_000_000, temperature="0.6", top_p="1", top_k=-1, min_p="0.05",
                           repetition_penalty="2", stop_token_ids=[0, 2**31 - 1])
SEED = 2**63 - 1  # seeds.py draws 63-bit seeds; 0.5.21+ verify [-2**63, 2**63 - 1]


def test_the_sampling_spec_used_here_sets_every_field_the_spec_has():
    assert set(SamplingSpec.model_fields) == set(EVERY_FIELD.model_dump(exclude_none=True))
    produced = set(EVERY_FIELD.merged_over(DefaultSamplingSpec()).to_sglang())
    assert produced == {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                        "stop_token_ids"}


def body_for(version: str) -> dict[str, Any]:
    facts = ServerFacts.read(URL, {"version": version, "dp_size": 2, "max_req_input_len": 10_000,
                                   "max_total_num_tokens": 20_000})
    client = GenerateClient([URL], **client_options([facts], reasoning_model=True))
    assert seeds_accepted([facts])
    return client.request_body(URL, [1, 2, 3], EVERY_FIELD.merged_over(DefaultSamplingSpec()).to_sglang(), SEED,
                               ("dataset", 7))


@pytest.mark.parametrize("version", SUPPORTED_RELEASES)
def test_the_body_the_client_sends_passes_the_releases_own_request_schema(version: str) -> None:
    body = body_for(version)
    at_least = version_key(version).__ge__
    assert ("return_prompt_token_ids" in body) == at_least(version_key("0.5.13.post1"))
    assert ("routed_dp_rank" in body) == at_least(version_key("0.5.10.post1"))
    assert ("require_reasoning" in body) == release(version).has_reasoning_tokens
    gate = api_types(version)
    if gate is not None:
        decoded = gate.GenerateRequest.from_json_value(body)  # raises JsonContractError where the server says 400
        params = decoded.sampling_params
        assert (params.max_new_tokens, params.temperature, params.top_p, params.top_k) == (1_000_000, 0.6, 1.0, -1)
        assert (params.min_p, params.repetition_penalty, params.sampling_seed) == (0.05, 2.0, SEED)
        assert params.stop_token_ids == [0, 2**31 - 1]
        assert decoded.routed_dp_rank == body["routed_dp_rank"] and decoded.input_ids == [1, 2, 3]
        with pytest.raises(gate.JsonContractError, match="unknown field `frequency_penaltyy`"):
            gate.GenerateRequest.from_json_value({**body, "sampling_params": {"frequency_penaltyy": 0.1}})
        with pytest.raises(gate.JsonContractError, match="expected i64"):  # the gate is live: types are checked
            gate.GenerateRequest.from_json_value({**body, "sampling_params": {"max_new_tokens": 1.0}})
        return
    accepted = keyword_fields(version, SAMPLING, "SamplingParams")
    request_fields = keyword_fields(version, IO_STRUCT, "GenerateReqInput")
    assert accepted and request_fields, f"{version}: SamplingParams / GenerateReqInput not found in the wheel"
    assert set(body["sampling_params"]) <= set(accepted), set(body["sampling_params"]) - set(accepted)
    assert set(body) <= set(request_fields), set(body) - set(request_fields)
    # tokenmill's own record of the keys each release takes agrees with the wheel.
    assert set(body["sampling_params"]) <= set(release(version).sampling_keys)
