"""The plan checked on the GPUs: SGLang's /metrics text read into (batch, step) samples, the verification window
gathered pass by pass, and the PlanVerified condition the pure decision records from it."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from tokenmill_operator.decide import names
from tokenmill_operator.decide.facts import JobState, Observed, ServerState
from tokenmill_operator.decide.lifecycle import decide, predicted_step
from tokenmill_operator.decide.planner import Prediction, ServerPlan
from tokenmill_operator.decide.server_metrics import Scrape, VerificationWindow, WindowFacts, combine, parse_metrics
from tokenmill_operator.decide.status import DatasetGenerationStatus
from tokenmill_operator.observe.gather import observe_window
from tokenmill_runner.facts.refit import StepSample
from tokenmill_runner.facts.releases import release
from tokenmill_sim.metrics import SchedulerSnapshot, SimMetrics

T0 = datetime(2026, 12, 2, 6, 0, tzinfo=UTC)

# Two DP attention groups of one replica, as SGLang 0.5.23 writes them (one series per reporting scheduler).
SGLANG_TEXT = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="kimi",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 60.0
sglang:num_running_reqs{dp_rank="1",engine_type="unified",model_name="kimi",moe_ep_rank="0",pp_rank="0",tp_rank="4"} 68.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",engine_type="unified",model_name="kimi",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 3.0
sglang:num_queue_reqs{dp_rank="1",engine_type="unified",model_name="kimi",moe_ep_rank="0",pp_rank="0",tp_rank="4"} 1.0
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{dp_rank="0",engine_type="unified",model_name="kimi",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 1500.0
sglang:gen_throughput{dp_rank="1",engine_type="unified",model_name="kimi",moe_ep_rank="0",pp_rank="0",tp_rank="4"} 1700.0
sglang:num_used_tokens{dp_rank="0",engine_type="unified",model_name="kimi",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 120000.0
sglang:num_used_tokens{dp_rank="1",engine_type="unified",model_name="kimi",moe_ep_rank="0",pp_rank="0",tp_rank="4"} 136000.0
# TYPE sglang:num_retracted_requests_total counter
sglang:num_retracted_requests_total{dp_rank="0",engine_type="unified",model_name="kimi",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 2.0
sglang:num_retracted_requests_total{dp_rank="1",engine_type="unified",model_name="kimi",moe_ep_rank="0",pp_rank="0",tp_rank="4"} 1.0
sglang:num_retracted_requests_created{dp_rank="0"} 1.7e9
sglang:gen_throughput_bogus 99
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="kimi"} 12.0
"""


def test_a_replicas_groups_are_summed_into_one_batch_and_step():
    scrape = parse_metrics(SGLANG_TEXT)
    assert scrape == Scrape(running=128, queued=4, gen_throughput=3200, used_tokens=256000, retracted_total=3,
                            groups=2)
    sample = scrape.sample()
    assert sample == StepSample(batch=128, context_tokens=2000, step_seconds=pytest.approx(0.04))


def test_the_simulators_metrics_read_as_sglangs_in_every_supported_release():
    snapshot = SchedulerSnapshot(num_running_reqs=32, num_queue_reqs=5, gen_throughput=800.0, num_used_tokens=64000,
                                 max_total_num_tokens=1_000_000, context_len=262144, retracted_total=7)
    for version in ("0.5.9", "0.5.23"):
        text = SimMetrics("m", lambda: snapshot, release(version)).exposition().decode()
        scrape = parse_metrics(text)
        assert scrape is not None and scrape.running == 32 and scrape.queued == 5
        assert scrape.sample() == StepSample(batch=32, context_tokens=2000, step_seconds=0.04)


@pytest.mark.parametrize("text", ["", "# metrics disabled\n", "up 1\nprocess_cpu_seconds_total 3\n",
                                  "sglang:num_running_reqs{} NaN\nsglang:gen_throughput{} 1\n",
                                  "sglang:num_running_reqs{a=\"}\"} x\n"])
def test_a_server_without_scheduler_gauges_gives_no_scrape(text: str):
    assert parse_metrics(text) is None


def test_an_idle_server_or_one_before_its_first_throughput_figure_gives_no_sample():
    assert Scrape(running=0, queued=3, gen_throughput=0, used_tokens=0).sample() is None
    assert Scrape(running=4, queued=0, gen_throughput=0, used_tokens=100).sample() is None


def test_the_window_opens_with_the_first_running_requests_and_counts_retractions_from_there():
    window = VerificationWindow()
    idle = Scrape(running=0, queued=0, gen_throughput=0, used_tokens=0, retracted_total=5)
    window.add(1, T0, {0: idle, 1: None})
    assert window.facts() is None
    busy = Scrape(running=10, queued=2, gen_throughput=500, used_tokens=10000, retracted_total=5)
    window.add(1, T0 + timedelta(seconds=15), {0: busy, 1: None})
    later = Scrape(running=40, queued=0, gen_throughput=1000, used_tokens=80000, retracted_total=9)
    window.add(1, T0 + timedelta(seconds=30), {0: later, 1: busy})
    facts = window.facts()
    assert facts is not None and facts.opened == T0 + timedelta(seconds=15)
    assert len(facts.samples) == 3 and facts.retractions == 4 and facts.queued == 2
    assert facts.seconds(T0 + timedelta(seconds=75)) == 60
    # A new plan starts its own window.
    window.add(2, T0 + timedelta(seconds=45), {0: idle})
    assert window.facts() is None


def test_the_edge_scrapes_every_replica_into_the_window():
    answers = {"http://r0:30000": SGLANG_TEXT, "http://r1:30000": None}
    window = VerificationWindow()
    facts = observe_window(window, [[url] for url in answers], 4, T0,
                           read=lambda url: parse_metrics(answers[url]) if answers[url] else None)
    assert facts is not None and [s.batch for s in facts.samples] == [128]


# -- multi-node replicas: each node's /metrics holds its own DP attention groups -------------------------------


def _sglang_reporting_nodes(tp: int, nnodes: int, dp: int) -> list[int]:
    """SGLang 0.5.23's own placement, step by step: node k launches TP ranks [k·T/N, (k+1)·T/N)
    (entrypoints/engine.py:2062-2077, managers/data_parallel_controller.py:702-712, pp 1); a TP rank's attention-TP
    width is T/D and its attention-TP rank r % (T/D) (runtime_context.py:73-92); the scheduler at attention-TP rank
    0 is the stats-logging one (observability/metrics_collector.py:1361-1366); its gauges go to its own node's
    multiprocess directory (utils/common.py:2825-2840), served by that node's /metrics (node rank >= 1:
    entrypoints/engine.py:1279-1285 -> utils/common.py:3651-3652)."""
    tp_size_per_node = tp // nnodes
    attn_tp_size = tp // dp
    return [node for node in range(nnodes)
            if any(rank % attn_tp_size == 0
                   for rank in range(tp_size_per_node * node, tp_size_per_node * (node + 1)))]


@pytest.mark.parametrize(("tp", "nnodes", "dp"), [(8, 1, 1), (8, 1, 4), (16, 2, 1), (16, 2, 2), (16, 2, 4),
                                                  (16, 2, 16), (16, 4, 2), (32, 4, 4), (32, 4, 8), (24, 3, 3)])
def test_the_nodes_that_report_a_replicas_groups_are_where_sglang_runs_their_schedulers(tp: int, nnodes: int,
                                                                                       dp: int):
    assert names.reporting_node_ranks(tp, nnodes, dp) == _sglang_reporting_nodes(tp, nnodes, dp)


def test_a_multi_node_dp_attention_replica_is_read_from_every_node_that_hosts_a_group():
    # 2 replicas of TP 16 over 2 nodes: pods 0-1 are replica 0, pods 2-3 replica 1.
    host = "http://x-server-{}.x-server.ns.svc:30000"
    assert names.metrics_urls("x", "ns", 30000, 2, 2, 16, 4) == [[host.format(0), host.format(1)],
                                                                  [host.format(2), host.format(3)]]
    # Without DP attention the one scheduler that reports is TP rank 0, on the rank-0 pod.
    assert names.metrics_urls("x", "ns", 30000, 2, 2, 16, 1) == [[host.format(0)], [host.format(2)]]
    # TP 16 + DP 2 over 4 nodes: group 1 reports from TP rank 8, node 2.
    assert names.metrics_urls("x", "ns", 30000, 1, 4, 16, 2) == [[host.format(0), host.format(2)]]
    # One node: the rank-0 pod, as the runner's URL.
    assert names.metrics_urls("x", "ns", 30000, 2, 1, 8, 4) == [[u] for u in names.server_urls("x", "ns", 30000, 2)]


def _node_text(groups: dict[int, tuple[int, float, float]]) -> str:
    """One node's /metrics: per dp_rank, (tp_rank, running, gen_throughput)."""
    lines = []
    for dp_rank, (tp_rank, running, throughput) in groups.items():
        labels = (f'dp_rank="{dp_rank}",engine_type="unified",model_name="kimi",moe_ep_rank="{tp_rank}",'
                  f'pp_rank="0",tp_rank="{tp_rank}"')
        lines += [f"sglang:num_running_reqs{{{labels}}} {running}", f"sglang:gen_throughput{{{labels}}} {throughput}",
                  f"sglang:num_queue_reqs{{{labels}}} 1.0", f"sglang:num_used_tokens{{{labels}}} {running * 1000}",
                  f"sglang:num_retracted_requests_total{{{labels}}} 1.0"]
    return "\n".join(lines) + "\n"


def test_a_multi_node_replicas_batch_and_step_are_summed_over_its_nodes():
    # TP 16 + DP 4 over 2 nodes: groups 0, 1 on node 0 (TP ranks 0, 4), groups 2, 3 on node 1 (TP ranks 8, 12).
    node0 = parse_metrics(_node_text({0: (0, 60, 1500), 1: (4, 68, 1700)}))
    node1 = parse_metrics(_node_text({2: (8, 62, 1550), 3: (12, 66, 1650)}))
    assert node0 is not None and node0.groups == 2 and node0.running == 128
    replica = combine([node0, node1])
    assert replica == Scrape(running=256, queued=4, gen_throughput=6400, used_tokens=256000, retracted_total=4,
                             groups=4)
    sample = replica.sample()
    assert sample is not None and sample.batch == 256 and sample.step_seconds == pytest.approx(0.04)
    # Read from the rank-0 pod only, the batch would be half, at the same step: the plan would read as off by 50 %.
    assert node0.sample() == StepSample(batch=128, context_tokens=1000, step_seconds=pytest.approx(0.04))
    assert combine([node0, None]) is None and combine([]) is None


def test_a_replica_whose_other_node_does_not_answer_gives_no_sample_that_pass():
    host = "http://x-server-{}.x-server.ns.svc:30000"
    answers = {host.format(0): _node_text({0: (0, 60, 1500), 1: (4, 68, 1700)}),
               host.format(1): _node_text({2: (8, 62, 1550), 3: (12, 66, 1650)}),
               host.format(2): _node_text({0: (0, 50, 1250), 1: (4, 50, 1250)}), host.format(3): None}
    window = VerificationWindow()
    facts = observe_window(window, names.metrics_urls("x", "ns", 30000, 2, 2, 16, 4), 1, T0,
                           read=lambda url: parse_metrics(answers[url]) if answers[url] else None)
    assert facts is not None and [s.batch for s in facts.samples] == [256]


def test_every_scheduler_reporting_or_a_priority_breakdown_counts_each_group_once():
    # --enable-metrics-for-all-schedulers: attention-TP ranks 1-3 of each group write their group's figures too
    # (0.5.23 observability/metrics_collector.py:1364-1367); priority scheduling adds per-priority series next to
    # the total under priority="" (metrics_collector.py:1389-1390, 1417-1429).
    text = _node_text({0: (0, 60, 1500), 1: (4, 68, 1700)})
    duplicates = _node_text({0: (1, 60, 1500), 1: (5, 68, 1700)}) + _node_text({0: (3, 60, 1500)})
    scrape = parse_metrics(duplicates + text)
    assert scrape == parse_metrics(text) and scrape is not None and scrape.running == 128 and scrape.groups == 2
    priority = ('sglang:num_running_reqs{model_name="kimi",priority="",tp_rank="0"} 40.0\n'
                'sglang:num_running_reqs{model_name="kimi",priority="0",tp_rank="0"} 30.0\n'
                'sglang:num_running_reqs{model_name="kimi",priority="5",tp_rank="0"} 10.0\n'
                'sglang:gen_throughput{model_name="kimi",priority="",tp_rank="0"} 1000.0\n')
    found = parse_metrics(priority)
    assert found is not None and found.running == 40 and found.groups == 1


# -- the decision --------------------------------------------------------------------------------------------

PREDICTION = Prediction(decode_tokens_per_second=6400, output_tokens_per_second=5000, eta_seconds=36000,
                        gpu_hours=80.0, batch_per_replica=128, bound="memory", samples=10000)
PLAN = ServerPlan(tensor_parallel=8, nodes_per_replica=1, gpus_per_node=8, replicas=2, mem_fraction_static="0.88",
                  context_length=131072, max_running_requests=512, kv_cache_dtype="auto", gpu_memory_mib=143771,
                  weight_bytes=594 * 10**9, weight_bytes_per_gpu=74 * 10**9, kv_bytes_per_token=70272,
                  kv_capacity_tokens=1_000_000, expected_tokens_per_request=6000,
                  concurrent_requests_at_expected_length=166, prediction=PREDICTION)


def running(window: WindowFacts | None, now: datetime = T0, previous: DatasetGenerationStatus | None = None,
            window_s: float = 600.0) -> Observed:
    return Observed(generation=3, now=now, suspended=False, previous=previous or DatasetGenerationStatus(
        planned_generation=3, server_plan=PLAN), plan=PLAN, server=ServerState(desired=2, ready=2),
        job=JobState(active=4, hash="h"), job_started=T0 - timedelta(minutes=5), desired_job_hash="h",
        window=window, verify_window_s=window_s)


def window_of(step_s: float, batch: float = 128, minutes: float = 10, retractions: int = 0) -> WindowFacts:
    ramp = [StepSample(b, 1500, step_s * 0.6) for b in (1, 4, 16)]
    steady = [StepSample(batch, 1500, step_s) for _ in range(20)]
    return WindowFacts(T0 - timedelta(minutes=minutes), tuple(ramp + steady), retractions, 3.0)


def condition(decision, type_="PlanVerified"):
    return next(c for c in decision.status.conditions if c.type == type_)


def test_the_plans_step_is_its_batch_over_a_replicas_decode_rate():
    step = predicted_step(PLAN)
    assert step is not None and step.seconds == pytest.approx(128 * 2 / 6400)
    # A plan stored before it recorded its context compares the step as it is.
    assert step.at(1500) == step.seconds


def test_while_the_window_is_open_the_check_is_unknown_and_says_how_far_it_got():
    waiting = decide(running(None))
    assert (condition(waiting).status, condition(waiting).reason) == ("Unknown", "Verifying")
    assert "first running requests" in condition(waiting).message
    half = decide(running(window_of(0.04, minutes=4)))
    assert (condition(half).status, condition(half).reason) == ("Unknown", "Verifying")
    assert "23 samples" in condition(half).message and half.status.verification is None
    assert not [e for e in half.events if e.reason in ("PlanVerified", "PlanOff")]


def test_a_server_running_as_planned_verifies_the_plan_with_both_figures_side_by_side():
    decision = decide(running(window_of(0.041)))
    verified = condition(decision)
    assert (verified.status, verified.reason) == ("True", "PlanVerified")
    assert "batch predicted 128, observed 128" in verified.message
    assert "step predicted 40.0 ms, observed 41.0 ms" in verified.message
    status = decision.status.verification
    assert status is not None and status.verified and status.samples == 23 and status.window_seconds == 600
    assert (status.predicted_step_milliseconds, status.observed_step_milliseconds) == ("40.0", "41.0")
    assert [e.reason for e in decision.events if e.reason.startswith("Plan")] == ["PlanVerified"]


def test_a_plan_off_by_more_than_the_tolerance_says_plan_off_with_the_numbers_once():
    decision = decide(running(window_of(0.06, batch=90, retractions=12)))
    off = condition(decision)
    assert (off.status, off.reason) == ("False", "PlanOff")
    assert "batch predicted 128, observed 90" in off.message and "observed 60.0 ms" in off.message
    assert "retractions 12" in off.message and "15%" in off.message
    assert [e.type for e in decision.events if e.reason == "PlanOff"] == ["Warning"]
    assert decision.status.verification is not None and not decision.status.verification.verified
    # The next passes keep it as it is: no second Event, the same figures.
    again = decide(running(window_of(0.03, minutes=20), T0 + timedelta(minutes=10), previous=decision.status))
    assert condition(again) == off and again.status.verification == decision.status.verification
    assert not [e for e in again.events if e.reason.startswith("Plan")]


def test_a_new_plan_is_checked_again():
    first = decide(running(window_of(0.06)))
    edited = first.status.model_copy(update={"planned_generation": 4})
    again = decide(replace(running(None, previous=edited), generation=4))
    assert (condition(again).status, condition(again).reason) == ("Unknown", "Verifying")


def test_the_window_length_is_the_resources():
    decision = decide(running(window_of(0.041, minutes=1), window_s=30))
    assert condition(decision).reason == "PlanVerified"
    assert decision.status.verification.window_seconds == 60


def test_a_plan_without_a_prediction_is_not_checked():
    observed = running(window_of(0.04))
    bare = PLAN.model_copy(update={"prediction": None})
    decision = decide(replace(observed, plan=bare))
    assert all(c.type != "PlanVerified" for c in decision.status.conditions)


def test_the_edge_reads_a_bounded_answer_and_gives_nothing_for_one_too_large_or_a_server_that_is_not_there():
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tokenmill_operator.observe.sglang_metrics import read_metrics

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            body = SGLANG_TEXT.encode() if self.path == "/metrics" else b""
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert read_metrics(url) == parse_metrics(SGLANG_TEXT)
        assert read_metrics(url, max_bytes=100) is None
    finally:
        server.shutdown()
        server.server_close()
    assert read_metrics(url, timeout_s=1) is None  # nothing listens there any more
    assert read_metrics("not a url") is None


def test_a_layout_the_operator_switched_to_is_checked_again_in_its_own_window():
    """replan auto (or a trial) switched the server: the switched layout's prediction is a plan of its own, so the
    verification made for the spec's layout does not cover it; its own window checks it, once."""
    from tokenmill_operator.decide.status import LayoutOverride

    first = decide(running(window_of(0.041)))
    assert first.status.verification is not None and first.status.verification.layout == ""
    override = LayoutOverride(generation=3, replicas=8, tensor_parallel=1, from_layout="2 x TP 4",
                              to_layout="8 x TP 1", reason="r", current_eta_seconds=2, new_eta_seconds=1,
                              gain_seconds=1, restart_seconds=1, margin_seconds=1, at="2026-11-29T12:00:00Z")
    switched = first.status.model_copy(update={"layout_override": override})
    waiting = decide(running(None, T0 + timedelta(minutes=20), previous=switched))
    assert (condition(waiting).status, condition(waiting).reason) == ("Unknown", "Verifying")
    checked = decide(running(window_of(0.06), T0 + timedelta(minutes=40), previous=switched))
    assert (condition(checked).status, condition(checked).reason) == ("False", "PlanOff")
    assert checked.status.verification is not None and checked.status.verification.layout == override.token
    again = decide(running(window_of(0.041), T0 + timedelta(minutes=50), previous=checked.status))
    assert again.status.verification == checked.status.verification, "checked once per layout"
    assert not [e for e in again.events if e.reason.startswith("Plan")]


def test_no_verification_while_a_trial_measures_its_candidates():
    from tokenmill_operator.decide.status import TrialStatus

    measuring = DatasetGenerationStatus(planned_generation=3, server_plan=PLAN,
                                        trial=TrialStatus(generation=3, phase="Measuring"))
    decision = decide(running(window_of(0.041), previous=measuring))
    assert (condition(decision).status, condition(decision).reason) == ("Unknown", "Verifying")
    assert "the trial measures its candidates first" in condition(decision).message
    assert decision.status.verification is None
    done = measuring.model_copy(update={"trial": TrialStatus(generation=3, phase="Done")})
    assert condition(decide(running(window_of(0.041), previous=done))).reason == "PlanVerified"
