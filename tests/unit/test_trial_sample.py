"""The measured trial's stratified sample: which rows each candidate's runner Job sends first
(tokenmill_runner/source/stratified.py), how the operator sizes it and hands it to each candidate's Job
(trialling.sample_of, manifests.runner_args / runner_job_hash), and that the runner refuses a malformed one."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tokenmill_operator.decide import manifests
from tokenmill_operator.decide.planner.trial import MEASURE_S, prompts_needed, sample_prompts
from tokenmill_operator.decide.status import DatasetGenerationStatus
from tokenmill_operator.decide.trialling import advance, begin, sample_of
from tokenmill_runner.cli import build_parser
from tokenmill_runner.source.stratified import (
    MIN_PER_DATASET,
    DatasetShare,
    SourceRows,
    allocate,
    first_lines,
    mix,
    stratify,
)
from tokenmill_runner.spec.config import MAX_TRIAL_PROMPTS, TrialSample

from .test_trialling import seeds_plan, steady, until_stop

DATASETS = [DatasetShare("B1_glaive", 11_000, 1_360), DatasetShare("B4_mixturethoughts", 11_000, 6_000),
            DatasetShare("B5_openthoughts", 11_000, 7_500), DatasetShare("B8_sweagent", 40, 3_000),
            DatasetShare("tiny", 5, 500)]


def test_the_stratified_sample_covers_every_dataset_in_the_jobs_mix_and_is_deterministic():
    candidates = ("dp4", "dp2", "dp8")
    samples = stratify(DATASETS, candidates, per_candidate=300, seed=7)
    counts = mix(samples)
    for c in candidates:
        assert set(counts[c]) == {d.name for d in DATASETS}, c
        assert counts[c]["B8_sweagent"] >= MIN_PER_DATASET
        assert counts[c]["tiny"] >= 1  # five rows for three candidates: one or more each
    # The output tokens each dataset brings to the sample follow its share of the job's.
    alloc = allocate(DATASETS, 300)
    means = {d.name: d.mean_output_tokens for d in DATASETS}
    job = {d.name: d.size * d.mean_output_tokens for d in DATASETS}
    for big in ("B1_glaive", "B4_mixturethoughts", "B5_openthoughts"):
        share_sample = alloc[big] * means[big] / sum(alloc[n] * means[n] for n in alloc)
        share_job = job[big] / sum(job.values())
        assert abs(share_sample - share_job) < 0.02, big
    # Disjoint across candidates, and the same for the same seed.
    rows = [set(samples[c]) for c in candidates]
    assert not (rows[0] & rows[1]) and not (rows[0] & rows[2]) and not (rows[1] & rows[2])
    assert stratify(DATASETS, candidates, 300, seed=7) == samples
    assert stratify(DATASETS, candidates, 300, seed=8) != samples
    assert all(0 <= i < next(d.size for d in DATASETS if d.name == n) for c in candidates for n, i in samples[c])
    # The order interleaves the datasets: the first dozen rows are not one dataset's.
    assert len({name for name, _ in samples["dp4"][:12]}) > 1


@pytest.mark.parametrize("per_candidate", [1, 10, 1000])
def test_allocation_floors_and_totals(per_candidate: int):
    alloc = allocate(DATASETS, per_candidate)
    assert all(alloc[d.name] >= min(MIN_PER_DATASET, d.size) for d in DATASETS)
    assert sum(alloc.values()) >= per_candidate


def test_row_indices_become_the_lines_that_yield_rows_and_every_candidate_gets_its_own():
    # A JSONL source with blank lines 2 and 5: its 8 rows are on lines 1, 3, 4, 6, 7, 8, 9, 10.
    skipped = np.zeros(10, dtype=bool)
    skipped[[1, 4]] = True
    sources = [SourceRows("a", 8, skipped), SourceRows("b", 30)]
    picked = [first_lines("3", c, 3, 12, {"a": 100.0, "b": 100.0}, sources) for c in range(3)]
    for lines in picked:
        assert set(lines["a"]) <= {1, 3, 4, 6, 7, 8, 9, 10} and lines["a"], lines
        assert set(lines["b"]) <= set(range(1, 31)) and lines["b"]
        positions = sorted([*lines["a"].values(), *lines["b"].values()])
        assert positions == list(range(len(positions)))  # one order over both datasets
    for x in range(3):
        for y in range(x + 1, 3):
            for name in ("a", "b"):
                assert not set(picked[x][name]) & set(picked[y][name]), (x, y, name)
    # Every Job of the trial computes the same: a restarted runner sends the same rows first.
    assert first_lines("3", 1, 3, 12, {"a": 100.0, "b": 100.0}, sources) == picked[1]
    # A dataset the plan gave no length is weighted at the others' mean, not left out.
    assert first_lines("3", 0, 3, 12, {"a": 100.0}, sources)["b"]


def test_the_sample_is_sized_for_the_hungriest_candidate_and_carried_by_the_status():
    plan = seeds_plan(11_000)
    step = begin(plan, generation=5)
    trial = step.trial
    assert trial.phase == "Measuring"
    prediction = plan.prediction
    assert prediction is not None
    mean_output = sum(d.samples * d.mean_output_tokens for d in prediction.datasets) / prediction.samples
    by_key = {(c.replicas, c.tensor_parallel, c.attention_data_parallel, c.kv_cache_dtype): c for c in plan.candidates}
    wanted = []
    for c in trial.candidates:
        p = by_key[c.key].prediction
        assert p is not None
        wanted.append(prompts_needed(p.batch_per_replica * c.replicas, MEASURE_S,
                                     p.decode_tokens_per_second / mean_output))
    assert trial.sample_prompts == max(wanted) == sample_prompts(plan, [c.layout for c in trial.candidates], MEASURE_S)
    assert 0 < trial.sample_prompts <= MAX_TRIAL_PROMPTS
    assert trial.sample_output_tokens == {d.name: d.mean_output_tokens for d in prediction.datasets}
    # The status round-trips as the API server keeps it.
    stored = DatasetGenerationStatus(trial=trial).model_dump(mode="json", by_alias=True, exclude_none=True)
    assert stored["trial"]["samplePrompts"] == trial.sample_prompts
    assert DatasetGenerationStatus.model_validate(json.loads(json.dumps(stored))).trial == trial
    # A skipped trial sends no sample.
    assert begin(seeds_plan(100), generation=5).trial.sample_prompts == 0
    assert sample_of(begin(seeds_plan(100), generation=5).trial) is None


def test_each_candidates_job_sends_its_own_sample_and_the_job_the_run_continues_on_keeps_it():
    plan = seeds_plan(11_000)
    trial = begin(plan, generation=2).trial
    trial = trial.model_copy(update={"candidates": trial.candidates[:2]})
    first = sample_of(trial)
    assert first is not None and (first.candidate, first.candidates, first.seed) == (0, 2, "2")
    spec = plan_spec()
    urls = ["http://s:30000"]
    hashes = {manifests.runner_job_hash(spec, urls, trial_sample=first.token())}
    args = manifests.runner_args(spec, urls, trial_sample=first.token())
    assert TrialSample.parse(args[args.index("--trial-sample") + 1]) == first
    # The first candidate measured: the second's Job sends the second sample, so its hash is another Job's.
    second_step = until_stop(trial, trial.candidates[0].key, steady(1000))
    second = sample_of(second_step.trial)
    assert second is not None and second.candidate == 1
    hashes.add(manifests.runner_job_hash(spec, urls, trial_sample=second.token()))
    assert len(hashes) == 2
    # The second is the fastest and the last measured: the run continues on its Job, sample and all (no restart).
    done = until_stop(second_step.trial, second_step.trial.candidates[1].key, steady(1300, seed=1))
    assert done.trial.phase == "Done" and done.switch_to is None
    assert sample_of(done.trial) == second
    # Had the first won, the run switches back: that Job sends no sample (its rows are the job's own order).
    slow = until_stop(second_step.trial, second_step.trial.candidates[1].key, steady(700, seed=1))
    assert slow.trial.phase == "Done" and slow.switch_to is not None
    assert sample_of(slow.trial) is None
    # Without a trial, the Job's hash and command line are what they always were.
    assert manifests.runner_job_hash(spec, urls) == manifests.runner_job_hash(spec, urls, trial_sample="")
    assert "--trial-sample" not in manifests.runner_args(spec, urls)
    assert advance(done.trial, done.trial.candidates[1].key, steady(1300), 1e9).trial == done.trial


def plan_spec():
    from tokenmill_runner.spec.resource import parse_document

    return parse_document({
        "apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "trial"},
        "spec": {"model": {"path": "s3://models/kimi-k2.5/"}, "datasets": [{"name": "B1", "source": "s3://p/b1.jsonl"}],
                 "output": {"uri": "s3://out/run/"}}}).spec


@pytest.mark.parametrize("text, says", [
    ('{"seed": "1", "candidate": 3, "candidates": 3, "prompts": 10}', "candidate 3 must be below"),
    ('{"seed": "1", "candidate": 0, "candidates": 3, "prompts": 0}', "prompts"),
    ('{"seed": "1", "candidate": 0, "candidates": 3, "prompts": 10, "extra": 1}', "extra"),
    ("not json", "JSON"),
    ('{"seed": "' + "x" * 70_000 + '"}', "over the 65,536 allowed"),
])
def test_a_malformed_trial_sample_is_refused_on_the_command_line_naming_what(text: str, says: str, capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["run", "spec.yaml", "--trial-sample", text])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--trial-sample" in err and says in err, err
