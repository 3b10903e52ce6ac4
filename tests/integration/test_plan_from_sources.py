"""`tokenmill plan examples/b5-openthoughts.yaml` where its model and its source are readable (moto's S3 server over
HTTP, the example unchanged but for --s3-endpoint): the rows and the prompt lengths come from the source, tokenized
with the model's own tokenizer and template, and the server's --context-length is what the job needs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tokenmill_runner import cli
from tokenmill_runner.render.pretokenize import PromptEncoder, load_tokenizer
from tokenmill_runner.source.reader import read_prompts
from tokenmill_runner.store.storage import open_storage, s3_client

REPO = Path(__file__).resolve().parents[2]
KIMI = REPO / "tests" / "fixtures" / "tokenizers" / "kimi-k2.5"
SOURCE = REPO / "examples" / "prompts" / "reasoning.jsonl"


def test_the_b5_example_plans_from_its_source_and_its_models_tokenizer(s3_endpoint: str,
                                                                        capsys: pytest.CaptureFixture[str]):
    client = s3_client(s3_endpoint)
    for bucket in ("models", "tokenmill-data"):
        try:
            client.create_bucket(Bucket=bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
    model = open_storage("s3://models/moonshotai/Kimi-K2.5/", s3_endpoint)
    fixture = json.loads((REPO / "tests" / "fixtures" / "models" / "kimi-k2.5.json").read_text())
    for path in KIMI.iterdir():
        if path.is_file() and path.name != "config.json":
            model.put(path.name, path.read_bytes())
    model.put("config.json", json.dumps(fixture["config"]).encode())
    model.put("model.safetensors.index.json", json.dumps({"metadata": {"total_size": fixture["weight_bytes"]},
                                                          "weight_map": {}}).encode())
    open_storage("s3://tokenmill-data/prompts/", s3_endpoint).put("B5_openthoughts.jsonl", SOURCE.read_bytes())

    assert cli.main(["plan", str(REPO / "examples" / "b5-openthoughts.yaml"), "--s3-endpoint", s3_endpoint]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("  B5_openthoughts: "))
    rows = sum(1 for raw in SOURCE.read_text().splitlines() if raw.strip())
    assert line.startswith(f"  B5_openthoughts: {rows} samples (counted: {rows} rows)")
    tokenizer = load_tokenizer(str(KIMI), trust_remote_code=True)
    prompts = list(read_prompts(str(SOURCE), "jsonl"))
    counts = [len(ids) for ids in PromptEncoder(tokenizer).encode_batch(prompts)]
    assert f"prompts {round(sum(counts) / len(counts)):,} tokens (sampled)" in line
    assert "model facts: built in" not in out  # the model's own files were read
    context = int(next(line for line in out.splitlines() if line.startswith("context length")).split()[-1]
                  .replace(",", ""))
    assert max(counts) + 32768 <= context < 262144  # the job's need: the longest prompt, twice, + maxNewTokens
    served = re.search(r"--context-length\W+(\d+)", out)  # the server's own flag, in the StatefulSet printed
    assert served is not None and int(served.group(1)) == context
