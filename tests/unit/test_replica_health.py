"""The circuit breaker per replica and the outage clock (replica_health.py), with time passed in."""

import pytest

from tokenmill_runner.generate.replica_health import HealthPolicy, ReplicaSet, State

POLICY = HealthPolicy(open_after=3, probe_first_s=1.0, probe_max_s=8.0, outage_budget_s=100.0)


def replicas(*urls: str) -> ReplicaSet:
    return ReplicaSet(list(urls), POLICY)


def test_nothing_listening_takes_a_replica_out_at_once():
    pool = replicas("a", "b")
    assert pool.record_failure("a", 0.0, "refused", unreachable=True, jitter=0.0)
    assert pool.live() == ["b"]


def test_server_errors_take_it_out_only_in_a_row():
    pool = replicas("a")
    assert not pool.record_failure("a", 0.0, "503", unreachable=False, jitter=0.0)
    assert not pool.record_failure("a", 0.0, "503", unreachable=False, jitter=0.0)
    pool.record_success("a")
    assert not pool.record_failure("a", 0.0, "503", unreachable=False, jitter=0.0)
    assert not pool.record_failure("a", 0.0, "503", unreachable=False, jitter=0.0)
    assert pool.record_failure("a", 0.0, "503", unreachable=False, jitter=0.0)
    assert pool.live() == []


def test_requests_go_to_the_least_loaded_live_replica_and_a_retry_elsewhere():
    pool = replicas("a", "b", "c")
    assert pool.pick({"a": 3, "b": 1, "c": 2}) == "b"
    assert pool.pick({"a": 3, "b": 1, "c": 2}, avoid="b") == "c"
    pool.record_failure("c", 0.0, "refused", unreachable=True, jitter=0.0)
    assert pool.pick({"a": 3, "b": 1, "c": 0}, avoid="b") == "a"
    pool.record_failure("a", 0.0, "refused", unreachable=True, jitter=0.0)
    assert pool.pick({}, avoid="b") == "b", "the only live replica, even for a retry"
    pool.record_failure("b", 0.0, "refused", unreachable=True, jitter=0.0)
    assert pool.pick({}) is None


def test_probes_back_off_with_jitter_and_a_healthy_answer_brings_it_back():
    pool = replicas("a")
    pool.record_failure("a", 10.0, "refused", unreachable=True, jitter=0.0)
    breaker = pool.breakers["a"]
    assert breaker.next_probe_at == 10.5  # the first probe after half to all of probe_first_s
    assert not pool.due_probes(10.4) and pool.due_probes(10.5) == ["a"]
    delays = []
    now = 10.5
    for _ in range(5):
        assert not pool.record_probe("a", now, healthy=False, message="HTTP 503", jitter=1.0)
        delays.append(breaker.next_probe_at - now)
        now = breaker.next_probe_at
    assert delays == [2.0, 4.0, 8.0, 8.0, 8.0]
    assert pool.record_probe("a", now, healthy=True, message="", jitter=0.0)
    assert pool.live() == ["a"] and breaker.state is State.LIVE


def test_a_replica_that_keeps_failing_after_coming_back_is_probed_later_each_time():
    pool = replicas("a")
    first_probes = []
    for _ in range(4):
        pool.record_failure("a", 0.0, "refused", unreachable=True, jitter=1.0)
        first_probes.append(pool.breakers["a"].next_probe_at)
        pool.record_probe("a", 0.0, healthy=True, message="", jitter=0.0)
    assert first_probes == [1.0, 2.0, 4.0, 8.0]
    pool.record_success("a")
    pool.record_failure("a", 0.0, "refused", unreachable=True, jitter=1.0)
    assert pool.breakers["a"].next_probe_at == 1.0, "a generation resets the flapping backoff"


def test_the_outage_clock_runs_while_no_replica_is_live_until_a_generation_succeeds():
    pool = replicas("a", "b")
    pool.record_failure("a", 5.0, "refused", unreachable=True, jitter=0.0)
    assert pool.outage_seconds(6.0) == 0.0, "one replica is still live"
    pool.record_failure("b", 7.0, "refused", unreachable=True, jitter=0.0)
    assert pool.outage_seconds(57.0) == 50.0
    pool.record_probe("b", 60.0, healthy=True, message="", jitter=0.0)
    assert pool.outage_seconds(80.0) == 73.0, "answering /health is not serving requests"
    assert not pool.outage_exceeded(107.0) and pool.outage_exceeded(107.5)
    pool.record_success("b")
    assert pool.outage_seconds(200.0) == 0.0 and not pool.outage_exceeded(200.0)


def test_replicas_known_down_at_the_start_are_probed_not_used():
    pool = ReplicaSet(["a", "b"], POLICY, initially_down=frozenset({"b"}))
    assert pool.live() == ["a"] and pool.due_probes(0.0) == ["b"]
    assert "b: down" in pool.describe()


def test_policy_rejects_nonsense():
    with pytest.raises(ValueError, match="open_after"):
        HealthPolicy(open_after=0)
    with pytest.raises(ValueError, match="probe_first_s"):
        HealthPolicy(probe_first_s=10.0, probe_max_s=1.0)


def test_a_server_failure_counts_against_the_sample_only_if_the_replica_kept_working():
    pool = replicas("a", "b")
    died = pool.suspect("a")
    pool.record_failure("a", 0.0, "refused", unreachable=True, jitter=0.0)
    pool.record_probe("a", 5.0, healthy=True, message="", jitter=0.0)
    pool.record_success("a")
    assert pool.charged([died]) == 0, "the replica went down after failing it: not the sample's fault"
    alone = pool.suspect("b")
    assert pool.charged([alone]) == 0, "nothing known yet"
    pool.record_success("b")
    assert pool.charged([alone, died]) == 1, "b answered others since: the failure was plausibly the sample's"
