"""Status and condition transitions of a DatasetGeneration, as pure decisions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from tokenmill_operator.lifecycle import (
    JobState,
    Observed,
    ProgressFacts,
    ServerState,
    decide,
    set_condition,
)
from tokenmill_operator.observe import progress_facts
from tokenmill_operator.planner import ServerPlan
from tokenmill_operator.status import DatasetGenerationStatus, Progress, ReportStatus

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
PLAN = ServerPlan(tensor_parallel=8, nodes_per_replica=1, gpus_per_node=8, replicas=1, mem_fraction_static="0.88",
                  context_length=131072, max_running_requests=512, kv_cache_dtype="auto", gpu_memory_mib=143771,
                  weight_bytes=594 * 10**9, weight_bytes_per_gpu=74 * 10**9, kv_bytes_per_token=70272,
                  kv_capacity_tokens=1_000_000, expected_tokens_per_request=6000,
                  concurrent_requests_at_expected_length=166)


def observed(**changes) -> Observed:
    base = dict(generation=3, now=T0, suspended=False, previous=DatasetGenerationStatus(), plan=PLAN,
                server=ServerState(desired=1, ready=1))
    base.update(changes)
    return Observed(**base)


def progress(completed: int, failed: int, total: int, last_commit: datetime | None = None) -> ProgressFacts:
    overall = Progress(completed=completed, failed=failed, total=total, display=f"{completed + failed}/{total}")
    return ProgressFacts(overall=overall, datasets=[], last_commit_time=last_commit)


def conditions(decision) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in decision.status.conditions}


def test_waits_for_the_server_before_the_runner():
    decision = decide(observed(server=ServerState(desired=1, ready=0)))
    assert decision.status.phase == "StartingServer" and not decision.create_job
    assert decision.server_replicas == 1
    assert conditions(decision)["ServerReady"] == ("False", "Starting")
    assert all(c.observed_generation == 3 for c in decision.status.conditions)


def test_unschedulable_server_carries_the_schedulers_reason():
    message = "pod x-server-0: 0/5 nodes are available: 3 Insufficient nvidia.com/gpu."
    decision = decide(observed(server=ServerState(1, 0, "Unschedulable", message)))
    [ready] = [c for c in decision.status.conditions if c.type == "ServerReady"]
    assert (ready.status, ready.reason, ready.message) == ("False", "Unschedulable", message)


def test_ready_server_starts_the_runner_job():
    decision = decide(observed())
    assert decision.create_job and decision.status.phase == "Generating"
    assert conditions(decision)["ServerReady"] == ("True", "ServerReady")
    assert conditions(decision)["Progressing"] == ("True", "Generating")


def test_stall_is_reported_once_with_an_event_and_keeps_its_transition_time():
    started = T0 - timedelta(hours=1)
    facts = progress(10, 0, 100, last_commit=T0 - timedelta(minutes=16))
    first = decide(observed(job=JobState(active=4), job_started=started, progress=facts))
    assert conditions(first)["Stalled"] == ("True", "NoCommits")
    assert [e.reason for e in first.events] == ["Stalled"]
    assert "nothing committed for 00:16:00 since the last commit" in first.events[0].message
    later = decide(observed(job=JobState(active=4), job_started=started, progress=facts, previous=first.status,
                            now=T0 + timedelta(minutes=1)))
    assert later.events == []
    [stalled] = [c for c in later.status.conditions if c.type == "Stalled"]
    assert stalled.last_transition_time == "2026-11-29T12:00:00Z"
    assert conditions(later)["Ready"] == ("False", "Degraded")


def test_recent_commit_is_not_a_stall():
    facts = progress(10, 0, 100, last_commit=T0 - timedelta(minutes=1))
    decision = decide(observed(job=JobState(active=4), job_started=T0 - timedelta(hours=2), progress=facts))
    assert conditions(decision)["Stalled"] == ("False", "Committing") and decision.events == []


def test_everything_committed_and_job_complete_writes_the_report_and_releases_gpus():
    decision = decide(observed(job=JobState(succeeded=4, complete=True), progress=progress(98, 2, 100)))
    assert decision.write_report and decision.server_replicas == 0
    assert decision.status.phase == "Reporting"


def test_report_means_succeeded_once():
    report = ReportStatus(uri="s3://b/run/report/report.json", verdict="warn", findings=["B1: truncated 6%"])
    decision = decide(observed(job=JobState(succeeded=4, complete=True), progress=progress(98, 2, 100),
                               remembered_report=report))
    assert decision.status.phase == "Succeeded" and decision.delete_server
    assert conditions(decision)["Succeeded"] == ("True", "ReportWritten")
    assert conditions(decision)["Ready"] == ("True", "Succeeded")
    assert decision.status.report.verdict == "warn" and decision.status.completion_time
    assert [e.reason for e in decision.events] == ["Succeeded"]
    again = decide(observed(remembered_report=report, previous=decision.status))
    assert again.events == []


def test_failed_job_fails_the_resource_with_its_message():
    job = JobState(failed=3, failed_message="runner Job failed (FailedIndexes): Job has failed indexes")
    decision = decide(observed(job=job))
    assert decision.status.phase == "Failed" and decision.delete_server
    assert conditions(decision)["Failed"] == ("True", "RunnerFailed")
    assert "failed indexes" in decision.status.message


def test_plan_error_fails_with_the_planners_words():
    decision = decide(observed(plan=None, plan_error="spec.server.tensorParallel 2 cannot hold 141 GB"))
    assert decision.status.phase == "Failed" and "tensorParallel" in decision.status.message


def test_job_complete_with_samples_missing_fails_with_what_to_do():
    decision = decide(observed(job=JobState(succeeded=4, complete=True), progress=progress(90, 0, 100)))
    assert decision.status.phase == "Failed"
    assert conditions(decision)["Failed"] == ("True", "SamplesMissing")
    assert "10 of 100 samples" in decision.status.message


def test_suspend_scales_to_zero_and_suspends_the_job():
    decision = decide(observed(suspended=True, job=JobState(active=4)))
    assert decision.status.phase == "Suspended" and decision.server_replicas == 0 and decision.suspend_job
    resumed = decide(observed(job=JobState(suspended=True), previous=decision.status))
    assert resumed.server_replicas == 1 and not resumed.suspend_job and resumed.status.phase == "Generating"


def test_condition_transition_time_moves_only_on_change():
    first = set_condition([], "Ready", "False", "Starting", "", T0, 1)
    same = set_condition(first, "Ready", "False", "StillStarting", "x", T0 + timedelta(minutes=5), 2)
    flipped = set_condition(same, "Ready", "True", "Generating", "", T0 + timedelta(minutes=9), 2)
    assert same[0].last_transition_time == first[0].last_transition_time and same[0].reason == "StillStarting"
    assert flipped[0].last_transition_time == "2026-11-29T12:09:00Z"


def marker(at: datetime, completions: list[int], failed: int = 0) -> dict:
    first = int(at.timestamp())  # distinct source lines per marker
    return {"committed_at": at.isoformat(),
            "samples": {"sample_id": [str(i) for i in range(len(completions))], "completion_tokens": completions,
                        "line": [first + i for i in range(len(completions))]},
            "failed": {"line": [first - 1 - i for i in range(failed)], "reason": ["invalid_json"] * failed}}


def test_progress_rates_and_eta_from_marker_times():
    started = T0 - timedelta(hours=1)
    markers = {"a": [marker(T0 - timedelta(minutes=30), [100] * 50),
                     marker(T0 - timedelta(minutes=5), [200] * 60, failed=0)],
               "b": [marker(T0 - timedelta(minutes=2), [50] * 40, failed=20)]}
    facts = progress_facts(markers, {"a": 500, "b": 100}, T0, started)
    overall = facts.overall
    assert (overall.completed, overall.failed, overall.total) == (150, 20, 600)
    assert overall.generated_tokens == 50 * 100 + 60 * 200 + 40 * 50
    # Only the last 10 minutes count: 60 + 40 + 20 samples, 12000 + 2000 tokens over 600 s.
    assert overall.samples_per_second == "0.200" and overall.tokens_per_second == 23
    assert overall.eta_seconds == (600 - 170) / 0.2 and overall.eta == "00:35:50"
    assert overall.display == "170/600 (28.3%)"
    assert [d.name for d in facts.datasets] == ["a", "b"] and facts.datasets[1].failed == 20
    assert facts.last_commit_time == T0 - timedelta(minutes=2)


def test_operator_metrics_follow_the_status_and_vanish_on_delete():
    from tokenmill_operator import metrics
    from tokenmill_operator.status import DatasetProgress

    report = ReportStatus(uri="s3://b/r/report/report.json", verdict="pass")
    decision = decide(observed(remembered_report=report, progress=ProgressFacts(
        overall=Progress(completed=90, failed=10, total=100, generated_tokens=5000, truncated=9),
        datasets=[DatasetProgress(name="B1", completed=90, failed=10, total=100, truncated=9)], last_commit_time=T0)))
    validation = {"max_truncated_fraction": "0.05", "max_error_fraction": "0.01"}
    metrics.publish("r", "ns", decision.status, validation, "s3://models/m/")
    value = metrics.REGISTRY.get_sample_value
    assert value("tokenmill_dsgen_phase", {"dsgen": "r", "namespace": "ns", "phase": "Succeeded"}) == 1
    assert value("tokenmill_dsgen_phase", {"dsgen": "r", "namespace": "ns", "phase": "Generating"}) == 0
    assert value("tokenmill_dsgen_samples_remaining", {"dsgen": "r", "namespace": "ns", "dataset": ""}) == 0
    assert value("tokenmill_dsgen_truncated_fraction", {"dsgen": "r", "namespace": "ns", "dataset": "B1"}) == 0.1
    assert value("tokenmill_dsgen_error_fraction", {"dsgen": "r", "namespace": "ns", "dataset": ""}) == 0.1
    assert value("tokenmill_dsgen_truncated_fraction_threshold", {"dsgen": "r", "namespace": "ns"}) == 0.05
    assert value("tokenmill_dsgen_condition", {"dsgen": "r", "namespace": "ns", "condition": "Succeeded",
                                               "status": "True"}) == 1
    assert value("tokenmill_dsgen_last_commit_timestamp_seconds", {"dsgen": "r", "namespace": "ns"}) == T0.timestamp()
    metrics.forget("r", "ns")
    assert b'dsgen="r"' not in metrics.exposition()


def test_republishing_drops_only_series_that_went_away():
    from tokenmill_operator import metrics

    validation = {"max_truncated_fraction": "0.05", "max_error_fraction": "0.01"}
    starting = decide(observed(server=ServerState(desired=1, ready=0)))
    metrics.publish("q", "ns", starting.status, validation, "m")
    value = metrics.REGISTRY.get_sample_value
    ready_false = {"dsgen": "q", "namespace": "ns", "condition": "ServerReady", "status": "False"}
    assert value("tokenmill_dsgen_condition", ready_false) == 1
    generating = decide(observed(previous=starting.status))
    metrics.publish("q", "ns", generating.status, validation, "m")
    assert value("tokenmill_dsgen_condition", ready_false) is None
    assert value("tokenmill_dsgen_condition", {**ready_false, "status": "True"}) == 1
    assert value("tokenmill_dsgen_phase", {"dsgen": "q", "namespace": "ns", "phase": "Generating"}) == 1
    metrics.forget("q", "ns")


def test_stall_window_comes_from_the_resource():
    facts = progress(10, 0, 100, last_commit=T0 - timedelta(minutes=3))
    short = decide(observed(job=JobState(active=1), job_started=T0 - timedelta(hours=1), progress=facts,
                            stall_after_s=120))
    assert conditions(short)["Stalled"] == ("True", "NoCommits")


def test_a_missing_secret_blocks_with_one_event_and_changes_nothing():
    from tokenmill_operator.lifecycle import blocked

    message = "Secret ns/s3-creds does not exist: create it"
    first = blocked(observed(), "MissingSecret", message)
    assert first.status.phase == "Pending" and first.server_replicas is None and not first.create_job
    assert conditions(first)["Ready"] == ("False", "MissingSecret") and first.status.message == message
    assert [e.reason for e in first.events] == ["MissingSecret"]
    again = blocked(observed(previous=first.status), "MissingSecret", message)
    assert again.events == []
    running = decide(observed())
    mid_run = blocked(observed(previous=running.status), "MissingSecret", message)
    assert mid_run.status.phase == "Generating", "a run in progress keeps its phase"
