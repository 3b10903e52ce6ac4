"""A plan made from sources of known lengths, checked against the job run on the simulator's scheduler model: the rows
counted are the rows, the prompt lengths are what the model's tokenizer gives, the outputs are the rows' earlier
answers, the planned --context-length holds every request and is what the job needs (not the model's 40,960), and
each dataset's predicted finish lands near when the simulated server finishes it."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tokenmill_operator.decide.planner import model_facts, plan_server, plan_step_model, workload
from tokenmill_operator.observe.workload_sample import SurveyReader, surveyed_workload
from tokenmill_runner.facts.known_models import known_model
from tokenmill_runner.facts.throughput import simulator_step
from tokenmill_runner.render.pretokenize import PromptEncoder, load_tokenizer
from tokenmill_runner.source.reader import read_prompts
from tokenmill_runner.spec.resource import load_spec_file
from tokenmill_sim.capacity import CapacityModel, Job, LinearStepTime, SchedulerParams

REPO = Path(__file__).resolve().parents[2]
QWEN3 = REPO / "tests" / "fixtures" / "tokenizers" / "qwen3"
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


def text(words: int, seed: int) -> str:
    return " ".join(WORDS[(seed + i * 7) % len(WORDS)] for i in range(words))


def write(path: Path, rows: int, prompt_words: int, answer_words: int) -> Path:
    path.write_text("".join(json.dumps({"sample_id": f"{path.stem}{i}", "messages": [
        {"role": "user", "content": text(prompt_words + i % 7, i)},
        {"role": "assistant", "content": text(answer_words + i % 11, i)}]}) + "\n" for i in range(rows)))
    return path


def test_a_plan_from_sources_of_known_lengths_matches_the_job_on_the_simulator(tmp_path: Path):
    short = write(tmp_path / "short.jsonl", 300, 20, 150)
    long = write(tmp_path / "long.jsonl", 90, 500, 700)
    document = {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "known"},
                "spec": {"model": {"path": "s3://models/Qwen/Qwen3-8B/", "tokenizer": str(QWEN3)},
                         "server": {"image": "lmsysorg/sglang:v0.5.23", "gpuProduct": "NVIDIA-H200", "gpusPerNode": 1,
                                    "replicas": 1, "tensorParallel": 1},
                         "sampling": {"maxNewTokens": 2048},
                         "datasets": [{"name": "short", "source": str(short)}, {"name": "long", "source": str(long)}],
                         "output": {"uri": "s3://out/run/"}}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(document))
    spec = load_spec_file(str(path)).spec
    facts = known_model(spec.model.path)
    assert facts is not None
    model = model_facts(facts.config, facts.weight_bytes)
    work = surveyed_workload(spec, workload(spec), str(QWEN3), SurveyReader())
    plan = plan_server(spec, model, work=work)

    # The rows as the runner will send them, tokenized as SGLang will see them.
    tokenizer = load_tokenizer(str(QWEN3))
    encoder = PromptEncoder(tokenizer)
    truth = {}
    for name, source in (("short", short), ("long", long)):
        prompts = list(read_prompts(str(source), "jsonl"))
        ids = encoder.encode_batch([p.__class__(**{**p.__dict__, "messages": p.messages[:1]}) for p in prompts])
        answers = [len(tokenizer(p.messages[1]["content"], add_special_tokens=False)["input_ids"]) for p in prompts]
        truth[name] = [(len(i), a) for i, a in zip(ids, answers, strict=True)]
    by_name = {d.name: d for d in work.datasets}
    for name, rows in truth.items():
        d = by_name[name]
        assert (d.samples, d.samples_known, d.rows_how) == (len(rows), True, f"counted: {len(rows)} rows")
        assert d.prompt_tokens == round(sum(p for p, _ in rows) / len(rows))
        assert d.outputs_from_answers and abs(d.mean_output() - sum(a for _, a in rows) / len(rows)) < 2

    longest = max(p + 2048 for rows in truth.values() for p, _ in rows)
    assert longest <= plan.context_length < 16384  # the job's need, not the model's 40,960

    # The same job on the simulator's scheduler, stepping as the plan's layout does.
    step = plan_step_model(spec, model)
    assert step is not None
    prediction = plan.prediction
    assert prediction is not None
    empty, per_request, prefill = simulator_step(step, prediction.batch_per_replica, work.held, work.prompt_tokens())
    server = CapacityModel(SchedulerParams(max_running_requests=plan.max_running_requests,
                                           max_total_tokens=plan.kv_capacity_tokens),
                           LinearStepTime(empty, per_request, prefill))
    order = [d.name for d in prediction.datasets]  # the runner's order, longest outputs first
    jobs = {name: [Job(p, a, 0.0, max_new_tokens=2048) for p, a in truth[name]] for name in order}
    for name in order:
        for job in jobs[name]:
            server.submit(job)
    while (when := server.next_event_time()) is not None:
        server.advance_to(when)
    for d in prediction.datasets:
        simulated = max(job.finished_at or 0.0 for job in jobs[d.name])
        assert abs(d.done_seconds / simulated - 1) < 0.15, (d.name, d.done_seconds, simulated)
