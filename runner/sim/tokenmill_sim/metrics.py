"""/metrics with the names and labels of the SGLang release being simulated, in a registry of its own (several
servers share a test process). Times are simulated seconds.

Labels (0.5.9 managers/scheduler_metrics_mixin.py:114-120, managers/tokenizer_manager.py:433-436; 0.5.11
managers/tokenizer_manager.py:461-463; 0.5.23 observability/metrics_collector.py:1383-1388, 1805-1812, 1858):
scheduler metrics carry model_name, engine_type, tp_rank, pp_rank and moe_ep_rank in every supported release;
tokenizer metrics carry only model_name until 0.5.10.post1 and model_name, engine_type from 0.5.11; from 0.5.17 the
request counters and latency histograms also carry is_streaming. `sglang:context_len` exists from 0.5.11.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmill_runner.facts.releases import Release, metric_in

# Bucket edges close to SGLang's (seconds).
LATENCY_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800,
                   2400, 3600, 7200)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 15, 20, 25,
                30, 60, 120, 300, 600)
STREAMING = "is_streaming"


@dataclass(frozen=True)
class SchedulerSnapshot:
    num_running_reqs: int
    num_queue_reqs: int
    gen_throughput: float
    num_used_tokens: int
    max_total_num_tokens: int
    context_len: int
    num_retracted_reqs: int = 0  # retracted by the last retraction
    retracted_total: int = 0

    @property
    def token_usage(self) -> float:
        return self.num_used_tokens / self.max_total_num_tokens if self.max_total_num_tokens else 0.0


class _SchedulerMetrics(Collector):
    GAUGES = ("num_running_reqs", "num_queue_reqs", "gen_throughput", "token_usage", "num_used_tokens",
              "max_total_num_tokens", "cache_hit_rate", "context_len", "num_retracted_reqs")

    def __init__(self, labels: dict[str, str], snapshot: Callable[[], SchedulerSnapshot], release: Release) -> None:
        self.labels = labels
        self.snapshot = snapshot
        self.gauges = tuple(n for n in self.GAUGES if metric_in(f"sglang:{n}", release.version))
        self.retracted_counter = metric_in("sglang:num_retracted_requests_total", release.version)

    def describe(self) -> Iterator[Metric]:
        # Names only, so registering does not read a server that has not started yet.
        for name in self.gauges:
            yield GaugeMetricFamily(f"sglang:{name}", "", labels=list(self.labels))
        if self.retracted_counter:
            yield CounterMetricFamily("sglang:num_retracted_requests", "", labels=list(self.labels))

    def collect(self) -> Iterator[Metric]:
        state = self.snapshot()
        values = {
            "num_running_reqs": ("The number of running requests.", state.num_running_reqs),
            "num_queue_reqs": ("The number of requests in the waiting queue.", state.num_queue_reqs),
            "gen_throughput": ("The generation throughput (token/s).", state.gen_throughput),
            "token_usage": ("The token usage.", state.token_usage),
            "num_used_tokens": ("The number of used tokens.", state.num_used_tokens),
            "max_total_num_tokens": ("Maximum total number of tokens in the KV cache pool.",
                                     state.max_total_num_tokens),
            "cache_hit_rate": ("The prefix cache hit rate.", 0.0),
            "context_len": ("The context length.", state.context_len),
            "num_retracted_reqs": ("The number of retracted requests.", state.num_retracted_reqs),
        }
        for name in self.gauges:
            documentation, value = values[name]
            family = GaugeMetricFamily(f"sglang:{name}", documentation, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), float(value))
            yield family
        if self.retracted_counter:
            counter = CounterMetricFamily("sglang:num_retracted_requests", "Total number of retracted requests.",
                                          labels=list(self.labels))
            counter.add_metric(list(self.labels.values()), float(state.retracted_total))
            yield counter


class SimMetrics:
    def __init__(self, model_name: str, snapshot: Callable[[], SchedulerSnapshot], release: Release) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        tokenizer_labels = {"model_name": model_name}
        if release.metric_engine_type_label:
            tokenizer_labels["engine_type"] = "unified"
        scheduler_labels = {"model_name": model_name, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0",
                            "moe_ep_rank": "0"}
        self.registry.register(_SchedulerMetrics(scheduler_labels, snapshot, release))
        # Non-streamed requests only: is_streaming is "false" wherever the release has the label.
        streaming = {**tokenizer_labels, STREAMING: "false"} if release.metric_is_streaming_label else tokenizer_labels

        def counter(name: str, documentation: str, labels: dict[str, str]) -> Counter:
            return Counter(name, documentation, list(labels), registry=self.registry).labels(**labels)

        def histogram(name: str, documentation: str, buckets: tuple[float, ...], labels: dict[str, str]) -> Histogram:
            return Histogram(name, documentation, list(labels), buckets=buckets,
                             registry=self.registry).labels(**labels)

        self.prompt_tokens = counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.", streaming)
        self.generation_tokens = counter("sglang:generation_tokens_total", "Number of generation tokens processed.",
                                         streaming)
        self.num_requests = counter("sglang:num_requests_total", "Number of requests processed.", streaming)
        self.num_aborted = counter("sglang:num_aborted_requests_total", "Number of requests aborted.",
                                   tokenizer_labels)
        self.e2e_latency = histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency "
                                     "in seconds", LATENCY_BUCKETS, streaming)
        self.ttft = histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS, streaming)
        self.queue_time = histogram("sglang:queue_time_seconds", "Histogram of queueing time in seconds.",
                                    LATENCY_BUCKETS, scheduler_labels)

    def observe_finished(self, prompt_tokens: int, completion_tokens: int, e2e: float, ttft: float,
                         queue_time: float) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.num_requests.inc()
        self.e2e_latency.observe(e2e)
        self.ttft.observe(ttft)
        self.queue_time.observe(queue_time)

    def observe_aborted(self) -> None:
        self.num_aborted.inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
