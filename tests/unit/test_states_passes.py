"""The operator's two hidden-state passes for SpecForge's offline layout (states_passes.py): the aux pass, then,
once its Job settled every sample, the server relaunched for the final state and a new Job for it; and what each
pass's server and runner are built with. The run itself, on the real API server: tests/e2e/test_states_passes.py."""

from __future__ import annotations

from datetime import timedelta

from tests.unit.test_lifecycle import JOB_HASH, T0, conditions, observed, progress
from tests.unit.test_manifests import URLS, container, flag, job, spec, statefulset
from tokenmill_operator.decide import manifests
from tokenmill_operator.decide.facts import JobState, ServerState
from tokenmill_operator.decide.lifecycle import decide
from tokenmill_operator.decide.states_passes import current_pass, next_pass, passes_of, run_key
from tokenmill_operator.decide.status import DatasetGenerationStatus, StatesPass
from tokenmill_operator.observe.gather import statefulset_rolling

SPECFORGE = {"hiddenStates__layouts": ["specforge"]}
AUX = StatesPass(kind="aux", run="3:", since="2026-11-29T10:00:00Z")


def test_only_layouts_that_need_the_final_state_have_passes_of_their_own():
    assert passes_of(spec()) == ()
    assert passes_of(spec(hiddenStates__layouts=[])) == (), "the aux layers alone: one Job, as before"
    assert passes_of(spec(**SPECFORGE)) == ("aux", "final")


def test_a_settled_aux_pass_restarts_the_server_for_the_final_state_and_replaces_the_job():
    finished = JobState(succeeded=4, complete=True, hash=JOB_HASH)
    decision = decide(observed(job=finished, progress=progress(98, 2, 100), states_passes=("aux", "final"),
                               states_pass=AUX))
    assert not decision.write_report, "no report before the final states are in"
    assert decision.replace_job and not decision.create_job and decision.server_replicas == 1
    assert decision.status.phase == "Generating"
    assert decision.status.states_pass == StatesPass(kind="final", run="3:", since="2026-11-29T12:00:00Z")
    assert conditions(decision)["Progressing"] == ("True", "NextStatesPass")
    [event] = decision.events
    assert event.reason == "StatesPass" and "final states" in event.message and "100/100" in event.message


def test_the_final_pass_settled_writes_the_report_and_an_unsettled_aux_pass_does_not_move_on():
    finished = JobState(succeeded=4, complete=True, hash=JOB_HASH)
    last = decide(observed(job=finished, progress=progress(100, 0, 100), states_passes=("aux", "final"),
                           states_pass=AUX.model_copy(update={"kind": "final"})))
    assert last.write_report and last.server_replicas == 0 and last.status.phase == "Reporting"
    missing = decide(observed(job=finished, progress=progress(90, 0, 100), states_passes=("aux", "final"),
                              states_pass=AUX))
    assert missing.status.phase == "Failed" and missing.status.states_pass == AUX


def test_a_new_generation_or_retry_starts_again_from_the_aux_pass():
    final = DatasetGenerationStatus(states_pass=AUX.model_copy(update={"kind": "final"}))
    passes = passes_of(spec(**SPECFORGE))
    assert current_pass(final, passes, run_key(3, ""), T0).kind == "final"
    for run in (run_key(4, ""), run_key(3, "1700000000")):  # an edit's plan; a retry that may generate samples
        fresh = current_pass(final, passes, run, T0)
        assert fresh.kind == "aux" and fresh.run == run and fresh.since == "2026-11-29T12:00:00Z"
    assert current_pass(final, (), run_key(3, ""), T0) is None
    assert next_pass(passes, AUX) == "final" and next_pass(passes, final.states_pass) is None


def test_each_pass_s_server_serves_only_its_kind_and_its_runner_captures_only_that():
    s = spec(**SPECFORGE)
    aux = container(statefulset(s))["args"]  # the default: the first pass (also `tokenmill plan`'s manifests)
    assert "--enable-return-aux-hidden-states" in aux and "--enable-return-hidden-states" not in aux
    final = container(statefulset(s, states_kind="final"))["args"]
    # 0.5.23 returns the aux layers in place of the final state when both are on (exec_.py:130-139).
    assert "--enable-return-hidden-states" in final
    assert not {"--enable-return-aux-hidden-states", "--speculative-algorithm"} & set(final)
    assert final[-2:] == ["--chunked-prefill-size", "4096"], "extraArgs still last"
    assert flag(container(job(s))["args"], "--states-pass") == "aux"
    second = manifests.runner_job("b5", "ns", {"uid": "u", "apiVersion": "v1", "kind": "X", "name": "b5"}, s, "img",
                                  URLS, states_pass="final")
    assert flag(second["spec"]["template"]["spec"]["containers"][0]["args"], "--states-pass") == "final"


def test_each_pass_is_its_own_job_and_runs_without_passes_keep_their_hash():
    s = spec(**SPECFORGE)
    aux, final = (manifests.runner_job_hash(s, URLS, states_pass=kind) for kind in ("aux", "final"))
    assert aux != final
    assert manifests.runner_job_hash(spec(), URLS) == manifests.runner_job_hash(spec(), URLS, states_pass="")
    assert "--states-pass" not in container(job(spec(hiddenStates__layouts=[])))["args"]


def test_a_server_still_rolling_is_not_ready_so_no_job_starts_on_the_old_flags():
    def sts(generation: int, observed_generation: int, current: str, update: str, updated: int) -> dict:
        return {"metadata": {"generation": generation}, "spec": {"replicas": 1},
                "status": {"observedGeneration": observed_generation, "currentRevision": current,
                           "updateRevision": update, "updatedReplicas": updated, "readyReplicas": 1}}

    assert statefulset_rolling(sts(2, 1, "a", "a", 1)), "the controller has not seen the new template"
    assert statefulset_rolling(sts(2, 2, "a", "b", 0)), "the old pod is still the one that is ready"
    assert not statefulset_rolling(sts(2, 2, "b", "b", 1))
    assert not statefulset_rolling({"metadata": {}, "spec": {"replicas": 1}, "status": {"readyReplicas": 1}})
    rolling = decide(observed(server=ServerState(desired=1, ready=1, rolling=True), states_passes=("aux", "final"),
                              states_pass=AUX.model_copy(update={"kind": "final"}),
                              previous=DatasetGenerationStatus(server_starting_since=(T0 - timedelta(minutes=1))
                                                               .isoformat())))
    assert not rolling.create_job and rolling.status.phase == "StartingServer"
