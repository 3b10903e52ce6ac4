"""Status and condition transitions of a DatasetGeneration, as pure decisions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from tokenmill_operator.decide.lifecycle import (
    JobState,
    Observed,
    ProgressFacts,
    ServerState,
    cannot_observe,
    decide,
    identity_change,
    plan_retry,
    reopen,
    set_condition,
)
from tokenmill_operator.decide.planner import ServerPlan
from tokenmill_operator.decide.progress import progress_facts
from tokenmill_operator.decide.status import DatasetGenerationStatus, Progress, ReportStatus, RunStatus, merge_patch
from tokenmill_runner.store.commit_index import DatasetIndex
from tokenmill_runner.store.ledger import DatasetLedger
from tokenmill_runner.store.manifest import DatasetLayout, Owner, RunManifest

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


JOB_HASH = "job-1"  # the runner Job whose runner wrote run.json


def progress(completed: int, failed: int, total: int, last_commit: datetime | None = None,
             spec_hash: str = JOB_HASH) -> ProgressFacts:
    overall = Progress(completed=completed, failed=failed, total=total, display=f"{completed + failed}/{total}")
    settled = completed + failed == total
    return ProgressFacts(overall=overall, datasets=[], last_commit_time=last_commit, settled=settled,
                         missing={} if settled else {"d": f"{total - completed - failed} slots have no outcome"},
                         spec_hash=spec_hash)


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
    decision = decide(observed(job=JobState(succeeded=4, complete=True, hash=JOB_HASH), progress=progress(98, 2, 100)))
    assert decision.write_report and decision.server_replicas == 0
    assert decision.status.phase == "Reporting"


def test_report_means_succeeded_once():
    report = ReportStatus(uri="s3://b/run/report/report.json", verdict="warn", findings=["B1: truncated 6%"])
    decision = decide(observed(job=JobState(succeeded=4, complete=True, hash=JOB_HASH), progress=progress(98, 2, 100),
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
    decision = decide(observed(job=JobState(succeeded=4, complete=True, hash=JOB_HASH), progress=progress(90, 0, 100)))
    assert decision.status.phase == "Failed"
    assert conditions(decision)["Failed"] == ("True", "SamplesMissing")
    assert "10 of 100 samples" in decision.status.message


def test_a_finished_job_waits_for_the_full_listing_before_anything_ends_the_run():
    from dataclasses import replace

    running = DatasetGenerationStatus(phase="Generating")
    for facts, job in ((progress(90, 0, 100), JobState(succeeded=4, complete=True, hash=JOB_HASH)),
                       (progress(100, 0, 100), JobState(succeeded=4, complete=True, hash=JOB_HASH)),
                       (progress(90, 0, 100), JobState(failed=1, failed_message="runner Job failed", hash=JOB_HASH))):
        held = decide(observed(job=job, progress=replace(facts, listing_incomplete=True), previous=running))
        assert held.status.phase == "Generating" and not held.write_report and not held.delete_server
        assert held.server_replicas is None, "the server is left as it is until the run's end is decided"
        assert conditions(held)["Progressing"] == ("True", "ListingMarkers")
        assert "Failed" not in conditions(held) and held.status.completion_time is None
    done = decide(observed(job=JobState(succeeded=4, complete=True, hash=JOB_HASH), progress=progress(100, 0, 100),
                           previous=running))
    assert done.write_report, "once the listing reached the end, the same figures end the run"


def test_while_the_operator_counts_the_markers_the_last_figures_stand_and_nothing_is_decided_on_them():
    # An operator without a checkpoint it trusts counts an output's markers from the first, a step a pass
    # (gather.OutputIndex.counting): no progress yet. The previous status's figures and last commit stand, no stall
    # is called (the newest commits are the last a count reaches) and a finished Job's end waits.
    started = T0 - timedelta(hours=5)
    before = decide(observed(job=JobState(active=4), job_started=started,
                             progress=progress(700, 0, 1000, last_commit=T0 - timedelta(minutes=1))))
    later = T0 + timedelta(minutes=30)  # the operator was away: the last commit it saw is 31 minutes old
    counting = decide(observed(job=JobState(active=4), job_started=started, previous=before.status, counting=True,
                               now=later))
    assert counting.status.progress == before.status.progress and counting.status.progress.completed == 700
    assert counting.status.last_commit_time == before.status.last_commit_time
    assert conditions(counting)["Stalled"] == ("False", "Committing") and counting.events == []
    assert "counting the output's commit markers" in counting.status.message
    assert "700/1000" in counting.status.message
    stalled = decide(observed(job=JobState(active=4), job_started=started, previous=before.status,
                              progress=progress(700, 0, 1000, last_commit=T0 - timedelta(minutes=1)), now=later))
    assert conditions(stalled)["Stalled"] == ("True", "NoCommits"), "once counted, the same figures can stall"
    ended = decide(observed(job=JobState(succeeded=4, complete=True, hash=JOB_HASH), job_started=started,
                            previous=before.status, counting=True, now=later))
    assert conditions(ended)["Progressing"] == ("True", "ListingMarkers") and ended.status.phase == "Generating"
    assert not ended.write_report and ended.server_replicas is None and conditions(ended)["Failed"][0] == "False"


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


def indexes(markers: dict[str, list[dict]]) -> dict[str, DatasetIndex]:
    """What the operator keeps per dataset after folding these markers (one shard each)."""
    built = {}
    for name, listed in markers.items():
        built[name] = DatasetIndex(DatasetLedger(name))
        for number, folded in enumerate(listed):
            built[name].fold(f"w000-t-{number:06d}", folded)
    return built


def marker(at: datetime, completions: list[int], failed: int = 0, first: int = 1) -> dict:
    """Rows of lines first.. and then failures of the lines after them."""
    after = first + len(completions)
    return {"committed_at": at.isoformat(),
            "samples": {"sample_id": [str(i) for i in range(len(completions))], "completion_tokens": completions,
                        "line": [first + i for i in range(len(completions))]},
            "failed": {"line": [after + i for i in range(failed)], "reason": ["invalid_json"] * failed}}


def test_progress_rates_and_eta_from_marker_times():
    started = T0 - timedelta(hours=1)
    markers = {"a": [marker(T0 - timedelta(minutes=30), [100] * 50),
                     marker(T0 - timedelta(minutes=5), [200] * 60, failed=0, first=51)],
               "b": [marker(T0 - timedelta(minutes=2), [50] * 40, failed=20)]}
    facts = progress_facts(indexes(markers), layout({"a": 500, "b": 100}), T0, started)
    overall = facts.overall
    assert (overall.completed, overall.failed, overall.total) == (150, 20, 600)
    assert overall.generated_tokens == 50 * 100 + 60 * 200 + 40 * 50
    # Only the last 10 minutes count: 60 + 40 + 20 samples, 12000 + 2000 tokens over 600 s.
    assert overall.samples_per_second == "0.200" and overall.tokens_per_second == 23
    # The ETA is the output tokens left at that token rate: a's 390 at its own mean (17,000 / 110), b's 40 at 50.
    assert overall.eta_seconds == int((390 * 17000 / 110 + 40 * 50) / (14000 / 600)) and overall.eta == "00:44:29"
    assert overall.display == "170/600 (28.3%)"
    assert [d.name for d in facts.datasets] == ["a", "b"] and facts.datasets[1].failed == 20
    assert facts.last_commit_time == T0 - timedelta(minutes=2)


def test_the_eta_follows_each_dataset_s_lengths_not_the_sample_rate_of_the_one_running():
    # Issue 27: datasets run one after another. 150 of 200 long answers (1,000 tokens) are in, 60 of them in the
    # last 10 minutes (100 tok/s, 0.1 samples/s); the short dataset (the plan: 100 tokens) has not started. What
    # is left takes 50 x 1,000 / 100 = 500 s and then 200 x 100 / 100 = 200 s; samples/s said 2,500 s.
    started = T0 - timedelta(hours=1)
    markers = {"long": [marker(T0 - timedelta(minutes=30), [1000] * 90),
                        marker(T0 - timedelta(minutes=5), [1000] * 60, first=91)]}
    facts = progress_facts(indexes(markers), layout({"long": 200, "short": 200}), T0, started,
                           expected_output={"long": 3000.0, "short": 100.0})
    assert facts.overall.samples_per_second == "0.100"
    assert facts.overall.eta_seconds == 700
    assert [(d.name, d.eta_seconds) for d in facts.datasets] == [("long", 500), ("short", 200)], \
        "each dataset's remaining work at the run's rate; the long one by its own mean, not the plan's"
    # Without a plan, a dataset with no answers yet is assumed as long as the run's answers so far.
    unplanned = progress_facts(indexes(markers), layout({"long": 200, "short": 200}), T0, started)
    assert unplanned.overall.eta_seconds == 500 + 2000


def test_operator_metrics_follow_the_status_and_vanish_on_delete():
    from tokenmill_operator import metrics
    from tokenmill_operator.decide.status import DatasetProgress

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
    from tokenmill_operator.decide.lifecycle import blocked

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


# ------------------------------------------------------------------------ faults, edits, retries (issue 10)
def given_up_progress(total: int = 100, completed: int = 90, reasons: dict[str, int] | None = None) -> ProgressFacts:
    reasons = reasons if reasons is not None else {"retries_exhausted": 8, "prompt_too_long": 2}
    retryable = {"retries_exhausted", "bad_response"}
    overall = Progress(completed=completed, failed=sum(reasons.values()), total=total, failed_by_reason=reasons,
                       given_up=sum(n for r, n in reasons.items() if r in retryable),
                       display=f"{total}/{total} (100.0%)")
    return ProgressFacts(overall=overall, datasets=[], last_commit_time=T0, settled=completed + sum(reasons.values())
                         == total, spec_hash=JOB_HASH)


def layout(lines: dict[str, int], samples: int = 1, spec_hash: str = JOB_HASH) -> RunManifest:
    return RunManifest(spec_hash=spec_hash,
                       datasets={name: DatasetLayout(rows=count, samples=samples) for name, count in lines.items()})


REPORT = ReportStatus(uri="s3://b/run/report/report.json", verdict="fail", findings=["8 samples given up"])


def test_a_run_with_given_up_samples_fails_with_counts_and_the_retry_annotation_never_succeeds():
    decision = decide(observed(name="b5", job=JobState(succeeded=4, complete=True, hash=JOB_HASH), progress=given_up_progress(),
                               remembered_report=REPORT))
    assert decision.status.phase == "Failed" and decision.delete_server
    assert conditions(decision)["Failed"] == ("True", "SamplesGivenUp")
    assert conditions(decision)["Succeeded"] == ("False", "SamplesGivenUp")
    message = decision.status.message
    assert "8 of 100 samples were given up" in message
    assert "retries_exhausted 8, prompt_too_long 2" in message
    assert 'kubectl annotate dsgen b5 tokenmill.io/retry-failed="$(date +%s)" --overwrite' in message
    assert decision.status.report == REPORT and [e.reason for e in decision.events] == ["SamplesGivenUp"]


def test_input_caused_failures_alone_still_succeed():
    progress = given_up_progress(reasons={"prompt_too_long": 3})
    decision = decide(observed(job=JobState(complete=True, hash=JOB_HASH), progress=progress, remembered_report=REPORT))
    assert decision.status.phase == "Succeeded", "bad input is a report finding, not a given-up sample"


def test_a_failed_job_whose_samples_all_have_an_outcome_is_reported_not_failed():
    # Workers that gave samples up exit 3; podFailurePolicy fails their index, so the Job ends Failed.
    job = JobState(succeeded=3, failed=1, failed_message="runner Job failed (FailedIndexes): Job has failed indexes",
                   hash=JOB_HASH)
    decision = decide(observed(job=job, progress=given_up_progress()))
    assert decision.write_report and decision.status.phase == "Reporting"


def test_a_terminal_failure_suspends_the_running_job_together_with_the_server():
    decision = decide(observed(plan=None, plan_error="model too large for 8 x 80 GB", job=JobState(active=4)))
    assert decision.status.phase == "Failed"
    assert decision.delete_server and decision.suspend_job, "no runner left without its server"


def test_deleting_the_job_after_samples_missing_starts_the_missing_work_again():
    failed = decide(observed(name="b5", job=JobState(succeeded=4, complete=True, hash=JOB_HASH), progress=progress(90, 0, 100)))
    assert failed.status.phase == "Failed" and "kubectl delete job b5-runner" in failed.status.message
    # The user deleted the Job: the server comes back first, then a new Job.
    restarting = decide(observed(name="b5", previous=failed.status, server=None, progress=progress(90, 0, 100)))
    assert restarting.status.phase == "StartingServer" and restarting.server_replicas == 1
    assert not restarting.delete_server and not restarting.create_job
    running = decide(observed(name="b5", previous=restarting.status, progress=progress(90, 0, 100)))
    assert running.create_job and running.status.phase == "Generating"
    assert conditions(running)["Failed"] == ("False", "InProgress")


def test_a_job_built_from_another_spec_is_replaced_then_recreated():
    old = JobState(active=4, hash="aaaa")
    replacing = decide(observed(job=old, desired_job_hash="bbbb"))
    assert replacing.replace_job and not replacing.create_job
    assert conditions(replacing)["Progressing"] == ("True", "ReplacingRunner")
    still_stopping = decide(observed(job=JobState(hash="aaaa", deleting=True), desired_job_hash="bbbb",
                                     previous=replacing.status))
    assert not still_stopping.replace_job and not still_stopping.create_job, "old pods first"
    wanted = RunStatus(model_path="s3://m/", tokenizer="s3://m/", output_uri="s3://o/", job_hash="bbbb")
    created = decide(observed(job=None, desired_job_hash="bbbb", wanted_run=wanted, previous=still_stopping.status))
    assert created.create_job and created.status.run == wanted


def test_same_hash_or_unknown_hash_keeps_the_job():
    assert not decide(observed(job=JobState(active=4, hash="bbbb"), desired_job_hash="bbbb")).replace_job
    # A Job made by an operator that recorded no hash is adopted rather than interrupted.
    assert not decide(observed(job=JobState(active=4, hash=None), desired_job_hash="bbbb")).replace_job


def test_an_edit_while_suspended_replaces_the_job_but_creates_none_until_resumed():
    decision = decide(observed(suspended=True, job=JobState(suspended=True, hash="aaaa"), desired_job_hash="bbbb"))
    assert decision.status.phase == "Suspended" and decision.replace_job and not decision.create_job
    gone = decide(observed(suspended=True, job=None, desired_job_hash="bbbb", previous=decision.status))
    assert gone.status.phase == "Suspended" and not gone.create_job and gone.server_replicas == 0


def test_a_completed_job_with_an_old_hash_is_replaced_before_reporting():
    decision = decide(observed(job=JobState(complete=True, hash="aaaa"), desired_job_hash="bbbb",
                               progress=progress(100, 0, 100)))
    assert decision.replace_job and not decision.write_report


def test_retry_annotation_accepted_once_when_something_was_given_up():
    first = plan_retry("1", None, given_up=8, now=T0)
    assert first.accepted and first.token == "1" and first.event.reason == "RetryRequested"
    assert first.status.handled == "1" and "8 given-up samples" in first.status.outcome
    again = plan_retry("1", first.status, given_up=8, now=T0 + timedelta(minutes=5))
    assert not again.accepted and again.token == "1" and again.event is None and again.status == first.status
    nothing = plan_retry("2", first.status, given_up=0, now=T0)
    assert not nothing.accepted and nothing.event.reason == "RetryNotNeeded"
    assert nothing.token == "1", "the Jobs keep the retry they were built for"
    assert plan_retry(None, None, given_up=3, now=T0).token == ""


def test_an_ended_run_reopens_for_a_retry_or_a_job_changing_edit_that_would_generate_something():
    gave_up = decide(observed(job=JobState(complete=True, hash=JOB_HASH), progress=given_up_progress(), remembered_report=REPORT))
    accepted = plan_retry("1", None, given_up=8, now=T0)
    assert reopen(gave_up.status, accepted, "bbbb", "aaaa")
    kept = plan_retry(None, None, given_up=8, now=T0)
    assert reopen(gave_up.status, kept, "bbbb", "aaaa"), "e.g. spec.runner.retryFailed set to true"
    assert not reopen(gave_up.status, kept, "aaaa", "aaaa")
    succeeded = decide(observed(job=JobState(complete=True, hash=JOB_HASH), progress=progress(100, 0, 100),
                                remembered_report=REPORT))
    assert not reopen(succeeded.status, kept, "bbbb", "aaaa", would_generate=False), \
        "an edit after success that adds nothing to generate (a sampling or validation change) keeps the GPUs off"
    # Succeeded means every slot of the spec is settled: raising samples or limit makes the spec ask for more.
    assert reopen(succeeded.status, kept, "bbbb", "aaaa", would_generate=True)
    failed = decide(observed(job=JobState(failed=4, failed_message="runner Job failed (BackoffLimitExceeded)",
                                          hash=JOB_HASH), progress=progress(50, 0, 100)))
    assert not reopen(failed.status, kept, "bbbb", "aaaa", would_generate=True), "a failure has no report to reopen"


def test_a_reopened_run_forgets_its_report_and_completion_time():
    gave_up = decide(observed(job=JobState(complete=True, hash="aaaa"), progress=given_up_progress(),
                              remembered_report=REPORT))
    assert gave_up.status.completion_time is not None
    again = decide(observed(job=JobState(complete=True, hash="aaaa"), progress=given_up_progress(),
                            previous=gave_up.status, reopened=True, desired_job_hash="bbbb"))
    assert again.replace_job and again.status.phase == "Generating"
    assert again.status.report is None and again.status.completion_time is None


def test_run_identity_change_is_refused_with_what_changed():
    started = RunStatus(model_path="s3://m/a/", tokenizer="s3://m/a/", output_uri="s3://o/x/")
    assert identity_change(None, started) is None
    assert identity_change(started, started.model_copy(update={"job_hash": "other"})) is None
    message = identity_change(started, started.model_copy(update={"output_uri": "s3://o/y/"}))
    assert "spec.output.uri changed from 's3://o/x/' to 's3://o/y/'" in message and "new DatasetGeneration" in message


def test_cannot_observe_keeps_phase_and_children_says_since_when_once():
    running = decide(observed(job=JobState(active=4)))
    first = cannot_observe(observed(previous=running.status), "cannot list s3://o/B5/commits/: 503 SlowDown")
    assert first.status.phase == "Generating" and first.server_replicas is None
    assert not (first.delete_server or first.suspend_job or first.create_job or first.replace_job)
    assert conditions(first)["Ready"] == ("False", "ObservationFailed")
    assert "503 SlowDown" in first.status.message and "failing since 2026-11-29T12:00:00Z" in first.status.message
    assert [e.reason for e in first.events] == ["ObservationFailed"]
    later = cannot_observe(observed(previous=first.status, now=T0 + timedelta(minutes=3)), "still 503")
    assert later.events == [] and "failing since 2026-11-29T12:00:00Z" in later.status.message
    recovered = decide(observed(job=JobState(active=4), previous=later.status))
    assert recovered.status.observation_failed_since is None
    assert conditions(recovered)["Ready"] == ("True", "Generating")


def test_status_merge_patch_removes_what_is_gone():
    old = {"phase": "Failed", "report": {"uri": "u", "verdict": "fail"}, "progress": {"failedByReason": {"a": 1},
                                                                                      "completed": 3}}
    new = {"phase": "Generating", "progress": {"failedByReason": {}, "completed": 3}}
    assert merge_patch(old, new) == {"phase": "Generating", "report": None, "progress": {"failedByReason": {"a": None}}}
    assert merge_patch(new, new) == {}


def test_given_up_counts_only_final_server_side_failures():
    def mk(at, rows, failures):
        return {"committed_at": at.isoformat(),
                "samples": {"sample_id": [f"s{line}" for line in rows], "line": rows, "completion_tokens": [5] * len(rows)},
                "failed": {"line": [line for line, _ in failures], "reason": [reason for _, reason in failures]}}
    markers = [
        mk(T0 - timedelta(minutes=9), [1, 2], [(3, "retries_exhausted"), (4, "bad_response"), (5, "prompt_too_long")]),
        mk(T0 - timedelta(minutes=5), [3], [(4, "bad_response"), (6, "retries_exhausted")]),  # line 3 retried fine
    ]
    facts = progress_facts(indexes({"a": markers}), layout({"a": 6}), T0, T0 - timedelta(minutes=10))
    overall = facts.overall
    assert overall.completed == 3 and overall.failed == 3
    assert overall.failed_by_reason == {"bad_response": 1, "prompt_too_long": 1, "retries_exhausted": 1}
    assert overall.given_up == 2, "prompt_too_long is the input's fault, not given up"
    assert facts.datasets[0].given_up == 2


def test_a_run_started_by_an_older_operator_records_what_it_runs_with():
    wanted = RunStatus(model_path="s3://m/", tokenizer="s3://m/", output_uri="s3://o/", job_hash="bbbb")
    decision = decide(observed(job=JobState(active=4), desired_job_hash="bbbb", wanted_run=wanted))
    assert decision.status.run == wanted.model_copy(update={"job_hash": ""}), "unknown hash: the Job is adopted"
    assert not decision.replace_job


def test_a_long_retry_value_is_kept_by_its_hash_and_handled_once():
    long = "x" * 1000
    first = plan_retry(long, None, given_up=2, now=T0)
    assert first.accepted and first.status.handled.startswith("sha256:") and len(first.status.handled) < 100
    assert not plan_retry(long, first.status, given_up=2, now=T0).accepted


def test_an_output_holding_another_models_run_fails_before_anything_runs():
    from tokenmill_operator.decide.progress import foreign_run
    from tokenmill_runner.spec.resource import parse_document

    spec = parse_document({"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "r"},
                           "spec": {"model": {"path": "s3://models/kimi/"}, "output": {"uri": "s3://o/run/"},
                                    "datasets": [{"name": "a", "source": "s3://p/a.jsonl"}]}}).spec
    owner = Owner(kind="DatasetGeneration", name="r", namespace="ns", uid="u1")
    assert foreign_run(None, None, spec, owner, 0.0) is None
    kimi = RunManifest(spec={"model": {"path": "s3://models/kimi/", "tokenizer": "/models/tok"}})
    assert foreign_run(kimi, None, spec, owner, 0.0) is None
    why = foreign_run(RunManifest(spec={"model": {"path": "s3://models/qwen/"}}), None, spec, owner, 0.0)
    assert "s3://o/run/ already holds a run of model 's3://models/qwen/'" in why
    decision = decide(observed(foreign_output=why, job=JobState(active=4)))
    assert conditions(decision)["Failed"] == ("True", "OutputInUse")
    assert decision.delete_server and decision.suspend_job


def test_a_lowered_samples_count_never_reads_as_every_sample_committed():
    # Issue 19 (review 1): 40 lines at samples 4, lines 1-20 fully committed (80 outcomes), samples lowered to 2.
    # 80 >= 40 x 2 used to end Succeeded; by slot, lines 21-40 lack samples 0 and 1.
    ledger = DatasetLedger("d", 40, 4)
    for index in range(4):
        ledger.fold({"shard_id": f"s{index}", "failed": {"line": [], "reason": []},
                     "samples": {"line": list(range(1, 21)), "sample_index": [index] * 20,
                                 "completion_tokens": [10] * 20}})
    facts = progress_facts({"d": DatasetIndex(ledger)}, layout({"d": 40}, samples=2), T0, T0)
    assert (facts.overall.completed, facts.overall.total, facts.settled) == (40, 80, False)
    assert facts.missing == {"d": "40 of 80 slots have no outcome (40 lines: 20 lack sample 0, 20 lack sample 1)"}
    decision = decide(observed(job=JobState(succeeded=1, complete=True, hash=JOB_HASH), progress=facts))
    assert conditions(decision)["Failed"] == ("True", "SamplesMissing") and not decision.write_report
    assert "20 lack sample 0, 20 lack sample 1" in decision.status.message


def test_a_job_that_ended_before_its_runner_recorded_the_layout_is_not_finished_work():
    # Review 2: the replaced Job failed before any worker rewrote run.json; the old run.json is settled.
    old = progress(50, 0, 50, spec_hash="job-of-generation-1")
    job = JobState(failed=4, failed_message="runner Job failed (BackoffLimitExceeded): ...", hash="job-of-generation-2")
    failed = decide(observed(job=job, progress=old))
    assert conditions(failed)["Failed"] == ("True", "RunnerFailed") and not failed.write_report
    # A Job whose pods all exited 0 without ever writing run.json (they had nothing to do): not reported either.
    job = JobState(succeeded=4, complete=True, hash="job-of-generation-2")
    decision = decide(observed(job=job, progress=old))
    assert conditions(decision)["Failed"] == ("True", "SamplesMissing") and not decision.write_report
    assert "ended before its runner recorded the run's layout" in decision.status.message
    assert "job-of-generation-1" in decision.status.message and "job-of-generation-2" in decision.status.message


def test_an_output_another_live_resource_writes_is_in_use_until_its_lease_goes_stale():
    from tokenmill_operator.decide.progress import foreign_run
    from tokenmill_runner.spec.resource import parse_document
    from tokenmill_runner.store.lease_rules import STALE_AFTER_S, Lease

    spec = parse_document({"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "r"},
                           "spec": {"model": {"path": "s3://models/kimi/"}, "output": {"uri": "s3://o/run/"},
                                    "datasets": [{"name": "a", "source": "s3://p/a.jsonl"}]}}).spec
    first = Owner(kind="DatasetGeneration", name="r", namespace="ns", uid="u1")
    recreated = first.model_copy(update={"uid": "u2"})
    # Renewed "a day ahead" by its holder's clock: only how long the operator saw it unchanged counts.
    lease = Lease(first, "r-runner-0", T0 - timedelta(hours=1), T0 + timedelta(days=1))
    assert foreign_run(None, lease, spec, first, 0.0) is None
    why = foreign_run(None, lease, spec, recreated, 0.0)
    assert "DatasetGeneration ns/r (uid u1)" in why and "its own output.uri" in why
    assert foreign_run(None, lease, spec, recreated, STALE_AFTER_S - 1)
    assert foreign_run(None, lease, spec, recreated, STALE_AFTER_S) is None


def test_an_edit_after_samples_were_given_up_reopens_only_when_the_new_job_would_generate_something():
    # Review 5: editing validation.maxErrorFraction after SamplesGivenUp recreated the server for a Job that skipped
    # every slot and ended SamplesGivenUp again.
    from tokenmill_operator.decide.progress import would_generate
    from tokenmill_runner.spec.resource import parse_document

    def spec(**changes):
        dataset = {"name": "a", "source": "s3://p/a.jsonl", "limit": 100, **changes.pop("dataset", {})}
        document = {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "r"},
                    "spec": {"model": {"path": "s3://m/"}, "output": {"uri": "s3://o/"}, "datasets": [dataset],
                             **changes}}
        return parse_document(document).spec

    ended = RunManifest(datasets={"a": DatasetLayout(rows=100, samples=1, limit=100)})
    assert not would_generate(spec(validation={"maxErrorFraction": "0.2"}), ended)
    assert would_generate(spec(runner={"retryFailed": True}), ended)
    assert would_generate(spec(dataset={"samples": 2}), ended)
    assert would_generate(spec(dataset={"limit": 200}), ended)
    gave_up = decide(observed(job=JobState(complete=True, hash=JOB_HASH), progress=given_up_progress(),
                              remembered_report=REPORT))
    kept = plan_retry(None, None, given_up=8, now=T0)
    assert not reopen(gave_up.status, kept, "bbbb", "aaaa", would_generate=False)
    assert reopen(gave_up.status, kept, "bbbb", "aaaa", would_generate=True)


def test_runner_pods_that_cannot_start_end_the_run_and_release_the_gpus_after_the_deadline():
    # Review 10: a wrong spec.runner.image (ImagePullBackOff) kept the GPU StatefulSet up indefinitely.
    job = JobState(active=2, hash=JOB_HASH, pod_problem=("ImagePullBackOff", "pod r-runner-0-x: Back-off pulling "
                                                          "image \"ghcr.io/typo/runner:1\""))
    early = decide(observed(job=job, job_started=T0 - timedelta(minutes=10), start_deadline_s=1800))
    assert early.status.phase == "Generating" and early.server_replicas == 1
    late = decide(observed(job=job, job_started=T0 - timedelta(minutes=31), start_deadline_s=1800))
    assert conditions(late)["Failed"] == ("True", "RunnerCannotStart")
    assert late.delete_server and late.suspend_job and late.server_replicas == 0
    assert "ImagePullBackOff" in late.status.message and "ghcr.io/typo/runner:1" in late.status.message
    # The suspended Job's pods are gone on the next pass: the run stays ended until the Job is replaced.
    after = decide(observed(job=JobState(suspended=True, hash=JOB_HASH), previous=late.status,
                            job_started=T0 - timedelta(minutes=31)))
    assert after.status.phase == "Failed" and after.delete_server
    replaced = decide(observed(job=JobState(suspended=True, hash=JOB_HASH), previous=late.status,
                               desired_job_hash="fixed-image"))
    assert replaced.status.phase == "Generating" and replaced.replace_job


def _starting(passes: list[timedelta], **changes) -> list:
    """decide() pass after pass for a run whose server is not ready, each pass fed the status the one before wrote,
    `passes` after the first."""
    crash = ServerState(1, 0, "CrashLoopBackOff", "pod r-server-0: back-off 5m0s restarting failed container sglang")
    decisions = [decide(observed(server=crash, **changes))]
    for after in passes:
        decisions.append(decide(observed(server=crash, now=T0 + after, previous=decisions[-1].status, **changes)))
    return decisions


def test_a_server_in_crash_loop_is_stalled_past_the_window_and_fails_past_its_start_deadline():
    # Issue 29 scenario 5: CrashLoopBackOff before the runner Job exists stayed StartingServer for ever, Stalled
    # False, the GPUs held. Deadline: spec.server.startDeadlineSeconds (here one hour); stall window 15 minutes.
    first, waiting, stalled, again, ended = _starting(
        [timedelta(minutes=10), timedelta(minutes=16), timedelta(minutes=30), timedelta(minutes=61)],
        stall_after_s=900, server_start_deadline_s=3600)
    assert first.status.phase == "StartingServer" and first.server_replicas == 1
    assert first.status.server_starting_since == "2026-11-29T12:00:00Z"
    assert conditions(waiting)["Stalled"] == ("False", "StartingServer") and waiting.status.phase == "StartingServer"
    assert conditions(stalled)["Stalled"] == ("True", "ServerNotReady") and stalled.server_replicas == 1
    assert [e.reason for e in stalled.events] == ["Stalled"] and not again.events, "the Event is said once"
    assert "CrashLoopBackOff" in next(c.message for c in stalled.status.conditions if c.type == "Stalled")
    assert conditions(ended)["Failed"] == ("True", "ServerCannotStart") and ended.status.phase == "Failed"
    assert ended.server_replicas == 0 and ended.delete_server
    assert "CrashLoopBackOff" in ended.status.message and "spec.server.startDeadlineSeconds" in ended.status.message
    assert [e.reason for e in ended.events] == ["ServerCannotStart"]


def test_the_server_start_deadline_follows_the_plans_predicted_start_up_and_ends_until_the_spec_is_edited():
    from tokenmill_operator.decide.lifecycle import MIN_SERVER_START_S, SERVER_START_FACTOR, server_start_deadline
    from tokenmill_operator.decide.planner.startup import StartupPlan

    startup = StartupPlan(source="copied from S3 into every pod", copy_seconds=1200, copy_holds_gpus=True,
                          load_seconds=600, load_bytes_per_second=10**9, probe_seconds=1800)
    plan = PLAN.model_copy(update={"startup": startup})
    assert server_start_deadline(observed(plan=plan)) == SERVER_START_FACTOR * 1800 == 5400
    small = startup.model_copy(update={"copy_seconds": 0, "load_seconds": 60, "probe_seconds": 1800})
    assert server_start_deadline(observed(plan=PLAN.model_copy(update={"startup": small}))) == MIN_SERVER_START_S
    assert server_start_deadline(observed(plan=plan, server_start_deadline_s=120)) == 120

    *_, before, ended = _starting([timedelta(seconds=5399), timedelta(seconds=5400)], plan=plan)
    assert before.status.phase == "StartingServer" and ended.status.phase == "Failed"
    assert "3x the plan's predicted start-up" in ended.status.message
    # The server is gone on the next pass: the run stays ended, and the GPUs released, while the spec is unchanged.
    gone = ServerState(desired=0, ready=0)
    after = decide(observed(server=gone, plan=plan, now=T0 + timedelta(hours=3), previous=ended.status))
    assert after.status.phase == "Failed" and after.server_replicas == 0
    # An edit (a new generation) starts the server again, its clock from zero.
    edited = decide(observed(server=gone, plan=plan, now=T0 + timedelta(hours=3), previous=after.status,
                             generation=4))
    assert edited.status.phase == "StartingServer" and edited.server_replicas == 1
    assert edited.status.server_starting_since == "2026-11-29T15:00:00Z"


def test_a_ready_server_clears_the_start_clock():
    [starting] = _starting([])
    ready = decide(observed(now=T0 + timedelta(hours=5), previous=starting.status))
    assert ready.status.phase == "Generating" and ready.create_job and ready.status.server_starting_since is None
