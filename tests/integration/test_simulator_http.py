"""The simulator over real HTTP (SimServer on a free port, httpx as the client): SGLang's schema, errors, health,
metrics, faults and API key."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill_sim.config import SimConfig
from tokenmill_sim.server import SimServer

# meta_info of the default release, 0.5.23 (managers/tokenizer_manager.py:2510-2557, 3604-3628).
META_KEYS = {"id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions", "reasoning_tokens",
             "completion_tokens", "cached_tokens", "e2e_latency"}
FAST = 1000.0  # simulated seconds per real second


def config(demo_model: Path, **overrides: Any) -> SimConfig:
    return SimConfig(model_path=str(demo_model), **{"time_scale": FAST, **overrides})


@pytest.fixture(scope="module")
def sim(demo_model: Path) -> Iterator[SimServer]:
    with SimServer(config(demo_model, max_running_requests=64)) as server:
        yield server


@pytest.fixture(scope="module")
def prompt(demo_model: Path) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(demo_model), local_files_only=True)
    messages = [{"role": "user", "content": "What is 17 times 23? Show your steps."}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def generate(url: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=body, timeout=30, **kwargs)


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {sample.name: sample.value for family in text_string_to_metric_families(text) for sample in family.samples}


# ---- /generate --------------------------------------------------------------------------------------------------
def test_single_request_has_sglang_schema(sim: SimServer, prompt: list[int]) -> None:
    response = generate(sim.url, {"input_ids": prompt, "rid": "one", "sampling_params": {"max_new_tokens": 20000}})
    assert response.status_code == 200 and response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"text", "output_ids", "meta_info"} and set(body["meta_info"]) == META_KEYS
    meta = body["meta_info"]
    assert meta["id"] == "one" and meta["prompt_tokens"] == len(prompt)
    assert meta["finish_reason"] == {"type": "stop", "matched": 4} and body["output_ids"][-1] == 4  # <|im_end|>
    assert len(body["output_ids"]) == meta["completion_tokens"] > 0
    assert (meta["cached_tokens"], meta["num_retractions"], meta["reasoning_tokens"]) == (0, 0, 0)
    assert meta["weight_version"] == "default"
    assert meta["e2e_latency"] >= meta["completion_tokens"] * 0.020  # simulated: one 20 ms step per token
    assert 15 in body["output_ids"] and "<|im_end|>" not in body["text"] and body["text"].strip()


def test_default_max_new_tokens_is_128(sim: SimServer, prompt: list[int]) -> None:
    body = generate(sim.url, {"input_ids": prompt, "sampling_params": {"ignore_eos": True}}).json()
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 128}
    assert len(body["output_ids"]) == 128


def test_batch_answers_a_list_in_order(sim: SimServer, prompt: list[int]) -> None:
    other = prompt[:-4] + prompt[-3:]
    body = {"input_ids": [prompt, other, prompt], "rid": "b",
            "sampling_params": [{"max_new_tokens": 5}, {"max_new_tokens": 7}, {"max_new_tokens": 9}]}
    answers = httpx.put(f"{sim.url}/generate", json=body, timeout=30).json()
    assert [a["meta_info"]["id"] for a in answers] == ["b_0", "b_1", "b_2"]
    assert [len(a["output_ids"]) for a in answers] == [5, 7, 9]
    assert [a["meta_info"]["prompt_tokens"] for a in answers] == [len(prompt), len(other), len(prompt)]
    assert answers[2]["output_ids"][:5] == answers[0]["output_ids"]  # same prompt, same output
    one = generate(sim.url, {"input_ids": [prompt], "return_prompt_token_ids": True}).json()
    assert isinstance(one, list) and len(one) == 1 and one[0]["prompt_token_ids"] == prompt


def test_outputs_depend_on_seed_and_prompt_only(demo_model: Path, sim: SimServer, prompt: list[int]) -> None:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 3000}}
    first = generate(sim.url, body).json()["output_ids"]
    with SimServer(config(demo_model, max_running_requests=2)) as same_seed, \
            SimServer(config(demo_model, seed=1)) as other_seed:
        assert generate(same_seed.url, body).json()["output_ids"] == first
        assert generate(other_seed.url, body).json()["output_ids"] != first


def test_bad_requests_get_sglang_messages(sim: SimServer, prompt: list[int]) -> None:
    cases = [
        ({"input_ids": []}, "input_ids cannot be empty."),
        ({"input_ids": [5] * 40000}, "The input (40000 tokens) is longer than the model's context length "
                                     "(32768 tokens)."),
        ({"input_ids": prompt, "sampling_params": {"max_new_tokens": 32768}},
         "Requested token count exceeds the model's maximum context length of 32768 tokens."),
        ({"text": "Hello"}, "input_ids"),
        # The scheduler's limit: max_req_input_len = min(32767, pool - 1) - 5 (0.5.23 managers/tp_worker.py:572).
        ({"input_ids": [5] * 32762}, "Input length (32762 tokens) exceeds the maximum allowed length (32762 tokens)"),
    ]
    for body, message in cases:
        response = generate(sim.url, body)
        assert response.status_code == 400, body
        assert message in response.json()["error"]["message"]
    # 0.5.22+: the JSON contract gate's string error (0.5.23 entrypoints/http_server.py:937-939).
    unknown = generate(sim.url, {"input_ids": prompt, "sampling_params": {"max_tokens": 10}})
    assert unknown.status_code == 400 and unknown.json()["error"].startswith("unknown field `max_tokens`")
    broken = httpx.post(f"{sim.url}/generate", content=b"{not json", timeout=30)
    assert broken.status_code == 400 and broken.json()["code"] == 400


async def test_a_rid_in_flight_cannot_be_reused(demo_model: Path, prompt: list[int]) -> None:
    with SimServer(config(demo_model, time_scale=50.0)) as server:
        body = {"input_ids": prompt, "rid": "dup", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            first = asyncio.create_task(client.post("/generate", json=body))
            await asyncio.sleep(0.02)
            second = await client.post("/generate", json=body)
            assert second.status_code == 400
            assert second.json() == {"error": {"message": "Duplicate request ID detected"}}
            assert (await first).status_code == 200
            assert (await client.post("/generate", json=body)).status_code == 200  # free again once answered


async def test_requests_wait_for_a_slot(demo_model: Path, prompt: list[int]) -> None:
    # Slow enough that real-time jitter (a few ms) is small against a 100-step request (about 0.1 s real).
    with SimServer(config(demo_model, time_scale=20.0, max_running_requests=4)) as server:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            answers = await asyncio.gather(*(client.post("/generate", json=body) for _ in range(12)))
    latencies = sorted(a.json()["meta_info"]["e2e_latency"] for a in answers)
    one_batch = 100 * 0.0202
    assert latencies[0] == pytest.approx(one_batch, rel=0.1)
    assert latencies[-1] == pytest.approx(3 * one_batch, rel=0.15)  # three waves through four slots


async def test_a_client_that_hangs_up_frees_its_slot(demo_model: Path, prompt: list[int]) -> None:
    with SimServer(config(demo_model, time_scale=100.0, max_running_requests=1)) as server:
        long = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 20000, "ignore_eos": True}}
        async with httpx.AsyncClient(base_url=server.url, timeout=0.2) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/generate", json=long)  # 400 s simulated, 4 s real
        short = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 10, "ignore_eos": True}}
        started = time.monotonic()
        assert generate(server.url, short).status_code == 200
        assert time.monotonic() - started < 2.0


# ---- health and info --------------------------------------------------------------------------------------------
def test_health_is_503_until_started(demo_model: Path) -> None:
    with SimServer(config(demo_model, startup_seconds=0.6)) as server:
        assert httpx.get(f"{server.url}/health").status_code == 503
        assert httpx.get(f"{server.url}/health_generate").status_code == 503
        time.sleep(0.7)
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert httpx.get(f"{server.url}/health_generate").status_code == 200


def test_model_and_server_info(sim: SimServer, demo_model: Path) -> None:
    info = httpx.get(f"{sim.url}/model_info").json()
    assert info["model_path"] == str(demo_model) and info["is_generation"] is True
    assert info["architectures"] == ["LlamaForCausalLM"] and info["weight_version"] == "default"
    assert httpx.get(f"{sim.url}/get_model_info").json() == info
    server = httpx.get(f"{sim.url}/server_info").json()
    # context_length is what was passed, None unless given; max_req_input_len = min(32768 - 1, pool - 1) - 5
    # (0.5.23 managers/tp_worker.py:568-572); keys 0.5.17/0.5.19/0.5.21 added.
    assert server["context_length"] is None and server["max_running_requests"] == 64
    assert server["max_total_num_tokens"] == sim.config.max_total_tokens and server["tp_size"] == 1
    assert server["max_req_input_len"] == 32762 and server["version"] == "0.5.23"
    assert {"startup_time", "kv_events", "launch_command", "frontend"} <= set(server)
    state = server["internal_states"][0]
    assert state["effective_max_running_requests_per_dp"] == 64 and "last_gen_throughput" in state
    assert server["simulator"]["time_scale"] == FAST and "api_key" not in server["simulator"]


def test_v1_models_answers_what_smg_asks_when_it_registers_a_worker(sim: SimServer, demo_model: Path) -> None:
    # smg 1.13.0 registers a worker by asking GET /health, then /v1/models (then /server_info and /model_info);
    # every supported release serves /v1/models (0.5.9 entrypoints/http_server.py:1421, 0.5.23 :1993) with one
    # ModelCard (0.5.9 entrypoints/openai/protocol.py:53, 0.5.23 :87): the served name and the context length.
    answer = httpx.get(f"{sim.url}/v1/models")
    assert answer.status_code == 200
    body = answer.json()
    assert body["object"] == "list" and len(body["data"]) == 1
    card = body["data"][0]
    assert card["id"] == card["root"] == str(demo_model) and card["object"] == "model"
    assert card["owned_by"] == "sglang" and card["max_model_len"] == 32768 and card["parent"] is None
    assert type(card["created"]) is int


def test_metrics_use_sglang_names_and_count(sim: SimServer, prompt: list[int]) -> None:
    before = metrics(sim.url)
    body = generate(sim.url, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 64}}).json()
    after = metrics(sim.url)
    for gauge in ("num_running_reqs", "num_queue_reqs", "gen_throughput", "token_usage", "num_used_tokens",
                  "max_total_num_tokens", "cache_hit_rate", "context_len"):
        assert f"sglang:{gauge}" in after
    assert after["sglang:num_requests_total"] == before["sglang:num_requests_total"] + 1
    assert after["sglang:prompt_tokens_total"] == before["sglang:prompt_tokens_total"] + len(prompt)
    assert after["sglang:generation_tokens_total"] == \
        before["sglang:generation_tokens_total"] + body["meta_info"]["completion_tokens"]
    for histogram in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "queue_time_seconds"):
        assert after[f"sglang:{histogram}_count"] == before[f"sglang:{histogram}_count"] + 1
    assert after["sglang:context_len"] == 32768
    text = httpx.get(f"{sim.url}/metrics").text
    assert 'sglang:num_running_reqs{engine_type="unified",model_name="' in text and 'tp_rank="0"' in text
    # 0.5.17+: is_streaming on the request counters (0.5.23 observability/metrics_collector.py:1858).
    assert 'sglang:num_requests_total{engine_type="unified",is_streaming="false",model_name="' in text


def test_metrics_of_an_older_release(demo_model: Path, prompt: list[int]) -> None:
    # sglang:context_len first appears in 0.5.11. 0.5.9: tokenizer metrics carry only model_name (0.5.9
    # managers/tokenizer_manager.py:433-436), no is_streaming; scheduler metrics model_name, engine_type, tp_rank,
    # pp_rank, moe_ep_rank (0.5.9 managers/scheduler_metrics_mixin.py:114-120).
    with SimServer(config(demo_model, sglang_version="0.5.9", served_model_name="m")) as server:
        generate(server.url, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8}})
        text = httpx.get(f"{server.url}/metrics").text
        body = generate(server.url, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8}}).json()
    assert 'sglang:num_requests_total{model_name="m"} 1.0' in text
    assert "sglang:context_len" not in text and "is_streaming" not in text
    assert 'sglang:num_running_reqs{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"}' \
        in text
    meta = body["meta_info"]
    assert "total_retractions" in meta and "num_retractions" not in meta and "reasoning_tokens" not in meta


async def test_gauges_show_a_busy_server(demo_model: Path, prompt: list[int]) -> None:
    with SimServer(config(demo_model, time_scale=50.0, max_running_requests=2)) as server:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            tasks = [asyncio.create_task(client.post("/generate", json=body)) for _ in range(5)]
            await asyncio.sleep(0.1)
            busy = metrics(server.url)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    assert busy["sglang:num_running_reqs"] == 2 and busy["sglang:num_queue_reqs"] == 3
    assert busy["sglang:gen_throughput"] == pytest.approx(2 / 0.0201)
    assert 0 < busy["sglang:token_usage"] < 1


# ---- faults -----------------------------------------------------------------------------------------------------
def test_fault_503(demo_model: Path, prompt: list[int]) -> None:
    with SimServer(config(demo_model, fault_503_rate=1.0)) as server:
        response = generate(server.url, {"input_ids": prompt})
        assert response.status_code == 503
        assert response.json() == {"object": "error", "message": "The request queue is full.", "type": "503",
                                   "param": None, "code": 503}
        assert metrics(server.url)["sglang:num_aborted_requests_total"] == 1


def test_fault_reset_drops_the_connection(demo_model: Path, prompt: list[int]) -> None:
    with SimServer(config(demo_model, fault_reset_rate=1.0)) as server:
        with pytest.raises(httpx.TransportError):
            generate(server.url, {"input_ids": prompt})
        assert httpx.get(f"{server.url}/health").status_code == 200  # the server itself is fine


def test_fault_abort(demo_model: Path, prompt: list[int]) -> None:
    with SimServer(config(demo_model, fault_abort_rate=1.0)) as server:
        body = generate(server.url, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 5000}}).json()
        reason = body["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["message"] and "status_code" in reason
        assert len(body["output_ids"]) == body["meta_info"]["completion_tokens"]


def test_fault_slow(demo_model: Path, prompt: list[int]) -> None:
    with SimServer(config(demo_model, fault_slow_rate=1.0, fault_slow_seconds=0.3)) as server:
        started = time.monotonic()
        assert generate(server.url, {"input_ids": prompt}).status_code == 200
        assert time.monotonic() - started >= 0.3


def test_faults_are_not_tied_to_the_prompt(demo_model: Path, prompt: list[int]) -> None:
    with SimServer(config(demo_model, fault_503_rate=0.5)) as server:
        codes = [generate(server.url, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8}}).status_code
                 for _ in range(30)]
    assert set(codes) == {200, 503}  # a retry of the same prompt can succeed


async def test_a_full_queue_answers_503(demo_model: Path, prompt: list[int]) -> None:
    with SimServer(config(demo_model, time_scale=100.0, max_running_requests=1, max_queued_requests=1)) as server:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            answers = await asyncio.gather(*(client.post("/generate", json=body) for _ in range(4)))
    codes = sorted(a.status_code for a in answers)
    assert codes == [200, 200, 503, 503]
    assert {a.json()["message"] for a in answers if a.status_code == 503} == {"The request queue is full."}


# ---- API key ----------------------------------------------------------------------------------------------------
def test_api_key_is_required_except_for_probes(demo_model: Path, prompt: list[int]) -> None:
    with SimServer(config(demo_model, api_key="sekret")) as server:
        denied = generate(server.url, {"input_ids": prompt})
        assert denied.status_code == 401 and denied.json() == {"error": "Unauthorized"}
        wrong = generate(server.url, {"input_ids": prompt}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert httpx.get(f"{server.url}/server_info").status_code == 401
        allowed = generate(server.url, {"input_ids": prompt}, headers={"Authorization": "Bearer sekret"})
        assert allowed.status_code == 200
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert httpx.get(f"{server.url}/metrics").status_code == 200


# ---- per-release behaviour that needs a running server ----------------------------------------------------------
def test_fault_nan_gives_sglang_s_nan_answer(demo_model: Path, prompt: list[int]) -> None:
    # _check_vocab_boundary_finish: the bad token becomes an end-of-sequence id, matched "NaN happened" (0.5.23
    # managers/schedule_batch.py:1989, 2019).
    with SimServer(config(demo_model, fault_nan_rate=1.0)) as server:
        body = generate(server.url, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 5000}}).json()
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": "NaN happened"}
    eos = 4  # examples/demo-model/config.json eos_token_id
    assert body["output_ids"][-1] == eos and len(body["output_ids"]) == body["meta_info"]["completion_tokens"]


def test_a_503_window_leaves_health_answering(demo_model: Path, prompt: list[int]) -> None:
    # A queue that stays full: /generate answers 503 (0.5.23 managers/scheduler.py:3562), while /health still gets
    # its one-token generation through and answers 200 (0.5.23 entrypoints/http_server.py:723).
    with SimServer(config(demo_model, fault_503_after_s=0.0, fault_503_for_s=0.5)) as server:
        assert generate(server.url, {"input_ids": prompt}).status_code == 503
        assert httpx.get(f"{server.url}/health").status_code == 200
        time.sleep(0.6)
        assert generate(server.url, {"input_ids": prompt}).status_code == 200


async def test_retractions_and_cached_tokens_are_reported(demo_model: Path, prompt: list[int]) -> None:
    # A pool too small for what the estimate admits: requests are retracted and counted in num_retractions; the
    # same prompt again finds all but its last token in the prefix cache (cached_tokens).
    sim = config(demo_model, time_scale=2000.0, max_total_tokens=6000, max_running_requests=32)
    with SimServer(sim) as server:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            answers = [a.json()["meta_info"] for a in
                       await asyncio.gather(*(client.post("/generate", json=body) for _ in range(12)))]
        final = metrics(server.url)
    assert sum(meta["num_retractions"] for meta in answers) == final["sglang:num_retracted_requests_total"] > 0
    assert all(meta["completion_tokens"] == 1500 for meta in answers)
    assert sorted(meta["cached_tokens"] for meta in answers)[-1] == len(prompt) - 1
