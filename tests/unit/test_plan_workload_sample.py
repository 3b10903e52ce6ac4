"""`tokenmill plan --sample-rows`: each dataset's prompts tokenized from a bounded sample of its rows (a real
tokenizer fixture), its outputs from the rows' earlier answers where they carry them, per-dataset finish times,
the --context-length the job needs, and the prediction's range."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tokenmill_operator.decide.planner import workload
from tokenmill_operator.observe.workload_sample import sampled_workload
from tokenmill_runner import cli
from tokenmill_runner.spec.resource import load_spec_file

REPO = Path(__file__).resolve().parents[2]
QWEN3 = REPO / "tests" / "fixtures" / "tokenizers" / "qwen3"
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


def text(words: int, seed: int) -> str:
    return " ".join(WORDS[(seed + i * 7) % len(WORDS)] for i in range(words))


@pytest.fixture
def job(tmp_path: Path) -> Path:
    data = json.loads((REPO / "tests" / "fixtures" / "models" / "kimi-k2.5.json").read_text())
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(data["config"]))
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": data["weight_bytes"]},
                                                                    "weight_map": {}}))
    short = tmp_path / "short.jsonl"  # short questions whose rows carry a long earlier answer
    short.write_text("".join(json.dumps({"sample_id": f"s{i}", "messages": [
        {"role": "user", "content": text(12, i)}, {"role": "assistant", "content": text(900, i)}]}) + "\n"
        for i in range(400)))
    long = tmp_path / "long.jsonl"  # long documents, no earlier answer
    long.write_text("".join(json.dumps({"sample_id": f"l{i}", "messages": [
        {"role": "user", "content": text(700 + i % 200, i)}]}) + "\n" for i in range(120)))
    spec = {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "sampled"},
            "spec": {"model": {"path": str(model), "tokenizer": str(QWEN3)},
                     "server": {"image": "lmsysorg/sglang:v0.5.23", "gpuProduct": "RTX-PRO-6000"},
                     "sampling": {"maxNewTokens": 4096},
                     "datasets": [{"name": "short", "source": str(short), "limit": 5000},
                                  {"name": "long", "source": str(long), "limit": 5000}],
                     "output": {"uri": "s3://out/run/"}}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_the_sample_is_bounded_and_gives_each_dataset_its_own_lengths(job: Path):
    spec = load_spec_file(str(job)).spec
    sampled = sampled_workload(spec, workload(spec), str(QWEN3), rows=100)
    short, long = sampled.datasets
    assert short.sample is not None and short.sample.rows == 100  # 400 rows in the source, 100 read
    assert long.sample is not None and long.sample.rows == 100
    assert 10 < short.prompt_tokens < 60 < 600 < long.prompt_tokens
    assert short.outputs_from_answers and not long.outputs_from_answers
    assert 800 < short.mean_output() <= 4096  # ~900 words of earlier answer, cut at maxNewTokens
    need = sampled.needed_context()
    assert need is not None and need == -(-(2 * long.longest_prompt + 4096) // 1024) * 1024


def test_tokenmill_plan_shows_per_dataset_etas_the_context_the_job_needs_and_the_range(
        job: Path, capsys: pytest.CaptureFixture[str]):
    assert cli.main(["plan", str(job), "--sample-rows", "100", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["contextLength"] < 262144
    prediction = plan["prediction"]
    names = {d["name"]: d for d in prediction["datasets"]}
    assert names["short"]["promptSource"] == "sampled" and names["short"]["outputSource"] == "earlier answers"
    assert names["long"]["outputSource"] == "seeds' shape"
    assert 0 < min(d["doneSeconds"] for d in names.values())
    assert max(d["doneSeconds"] for d in names.values()) <= prediction["generationSeconds"] + 1
    interval = prediction["interval"]
    rate = prediction["outputTokensPerSecond"]
    assert interval["outputTokensPerSecondLow"] <= rate <= interval["outputTokensPerSecondHigh"]
    assert interval["etaSecondsLow"] <= prediction["etaSeconds"] <= interval["etaSecondsHigh"]
    if plan["attentionDataParallel"] > 1:
        assert "DP attention over PCIe: unmeasured" in interval["basis"]
    assert cli.main(["plan", str(job), "--sample-rows", "100"]) == 0
    out = capsys.readouterr().out
    assert "range" in out and "  short: " in out and "(sampled)" in out
