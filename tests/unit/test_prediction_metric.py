"""The predicted throughput reaches Prometheus beside the observed one, so an alert can compare them."""

from __future__ import annotations

from tokenmill_operator import metrics
from tokenmill_operator.decide.planner import MemoryTerm, Prediction, ServerPlan
from tokenmill_operator.decide.status import DatasetGenerationStatus, Progress

VALIDATION = {"max_truncated_fraction": "0.05", "max_error_fraction": "0.01"}
PREDICTION = Prediction(decode_tokens_per_second=18000, output_tokens_per_second=8800, eta_seconds=1530,
                        gpu_hours=3.4, batch_per_replica=1224, bound="memory", samples=10000)


def plan(prediction: Prediction | None) -> ServerPlan:
    return ServerPlan(tensor_parallel=8, nodes_per_replica=1, gpus_per_node=8, replicas=1, mem_fraction_static="0.8",
                      context_length=262144, max_running_requests=16384, kv_cache_dtype="auto", gpu_memory_mib=143771,
                      weight_bytes=594 * 10**9, weight_bytes_per_gpu=88 * 10**9, kv_bytes_per_token=562176,
                      kv_capacity_tokens=3_668_776, expected_tokens_per_request=2992,
                      concurrent_requests_at_expected_length=1226, attention_data_parallel=8, prediction=prediction)


def test_the_predicted_rate_is_published_next_to_the_observed_one():
    status = DatasetGenerationStatus(phase="Generating", server_plan=plan(PREDICTION),
                                     progress=Progress(total=10000, tokens_per_second=2100))
    metrics.publish("p", "ns", status, VALIDATION, "s3://models/kimi/")
    value = metrics.REGISTRY.get_sample_value
    assert value("tokenmill_dsgen_predicted_tokens_per_second", {"dsgen": "p", "namespace": "ns"}) == 8800
    assert value("tokenmill_dsgen_tokens_per_second", {"dsgen": "p", "namespace": "ns", "dataset": ""}) == 2100
    # A plan without a prediction (no known GPU product) leaves the series absent rather than zero.
    metrics.publish("p", "ns", status.model_copy(update={"server_plan": plan(None)}), VALIDATION, "m")
    assert value("tokenmill_dsgen_predicted_tokens_per_second", {"dsgen": "p", "namespace": "ns"}) is None
    metrics.forget("p", "ns")
    assert b'dsgen="p"' not in metrics.exposition()


def test_the_predicted_batch_and_the_memory_split_are_published_beside_sglangs_running_requests():
    split = [MemoryTerm(name="prefill activations", mib=1015, source="chunk x per-token bytes"),
             MemoryTerm(name="safety margin", mib=4006, source="stated")]
    with_split = plan(PREDICTION).model_copy(update={"memory_split": split, "replicas": 2})
    status = DatasetGenerationStatus(phase="Generating", server_plan=with_split, progress=Progress(total=10000))
    metrics.publish("m", "ns", status, VALIDATION, "s3://models/kimi/")
    value = metrics.REGISTRY.get_sample_value
    key = {"dsgen": "m", "namespace": "ns"}
    assert value("tokenmill_dsgen_predicted_running_requests", key) == 2 * 1224  # batch per replica x replicas
    assert value("tokenmill_dsgen_plan_memory_mib", {**key, "use": "prefill activations"}) == 1015
    assert value("tokenmill_dsgen_plan_memory_mib", {**key, "use": "safety margin"}) == 4006
    assert value("tokenmill_dsgen_plan_memory_mib", {**key, "use": "weights"}) == 88 * 10**9 / 2**20
    # 3,668,776 tokens over 8 groups, each token 562,176 / 8 bytes on a rank of its group.
    assert value("tokenmill_dsgen_plan_memory_mib", {**key, "use": "kv cache"}) == 3_668_776 // 8 * 70272 / 2**20
    metrics.forget("m", "ns")
    assert value("tokenmill_dsgen_plan_memory_mib", {**key, "use": "weights"}) is None
