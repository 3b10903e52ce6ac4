"""Run outputs for the export tests: a real `tokenmill run` against the simulator, or committed rows built directly
(prompt ids from the model's own chat template, output ids chosen by the test) through the runner's own row builder
and commit protocol, for cases the simulator does not produce (a Qwen3-style `<think>` opening, ids a tokenizer
would not produce from their text)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from tokenmill_runner.cli import main
from tokenmill_runner.generate.results import Generation
from tokenmill_runner.generate.rows import build_row
from tokenmill_runner.render.pretokenize import PromptEncoder, describe_tokenizer, load_tokenizer
from tokenmill_runner.source.prompts import Prompt
from tokenmill_runner.store.ledger import ShardContent
from tokenmill_runner.store.shards import commit_shard
from tokenmill_runner.store.storage import LocalStorage

from .workloads import write_jsonl, write_spec


def simulated_run(tmp: Path, document: dict[str, Any]) -> Path:
    """`tokenmill run` of a spec document against the built-in simulator; returns the output folder."""
    spec = write_spec(tmp / "spec.yaml", document)
    out = document["spec"]["output"]["uri"]
    assert main(["-q", "run", str(spec), "--out", out, "--sim-time-scale", "2000"]) == 0
    return Path(out)


@dataclass(frozen=True)
class Sample:
    sample_id: str
    messages: list[dict[str, Any]]
    output: list[int] | str  # ids, or text encoded with the tokenizer
    stop: bool = True  # the output ends with the end-of-turn token (finish reason stop), else finish reason length
    tools: list[dict[str, Any]] | None = None


@dataclass
class BuiltRun:
    root: Path
    tokenizer: Any
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)  # sample_id -> committed row
    sources: dict[str, Path] = field(default_factory=dict)


def built_run(root: Path, model: Path, datasets: dict[str, list[Sample]], trust_remote_code: bool = False,
              template_kwargs: dict[str, dict[str, Any]] | None = None, shard_size: int = 2) -> BuiltRun:
    tokenizer = load_tokenizer(str(model), trust_remote_code)
    info = describe_tokenizer(tokenizer, str(model), ["</think>"], None, str(model))
    storage = LocalStorage(root / "out")
    built = BuiltRun(root / "out", tokenizer)
    encoder = PromptEncoder(tokenizer)
    # The end-of-turn token a chat model stops on (Qwen3 lists <|im_end|> and <|endoftext|> as EOS ids).
    eos = next((int(i) for i, text in info.eos_tokens.items() if text in ("<|im_end|>", "<|eot_id|>")),
               info.eos_token_ids[0])
    for dataset, samples in datasets.items():
        source = write_jsonl(root / f"{dataset}.jsonl", [
            {"sample_id": s.sample_id, "messages": s.messages, **({"tools": s.tools} if s.tools else {})}
            for s in samples])
        built.sources[dataset] = source
        kwargs = (template_kwargs or {}).get(dataset, {})
        rows = []
        for line, sample in enumerate(samples, start=1):
            prompt = Prompt(line, sample.sample_id, sample.messages, sample.tools)
            prompt_ids = encoder.encode_one(prompt, kwargs)
            output = sample.output if isinstance(sample.output, list) else \
                tokenizer(sample.output, add_special_tokens=False)["input_ids"]
            output = list(output) + ([eos] if sample.stop else [])
            generation = Generation(output, len(prompt_ids), len(output), "stop" if sample.stop else "length",
                                    eos if sample.stop else None, 0.1, 1, "test")
            row = build_row(dataset, prompt, prompt_ids, generation, 4096, info)
            rows.append(row)
            built.rows[sample.sample_id] = row
        for start in range(0, len(rows), shard_size):
            commit_shard(storage, dataset, f"w000-test-{start:06d}", 0, ShardContent(rows[start:start + shard_size], []))
    run = {
        "version": 1, "name": "built", "tokenmill": "test",
        "spec": {"model": {"path": str(model), "trustRemoteCode": trust_remote_code},
                 "datasets": [{"name": name, "source": str(built.sources[name]), "format": "auto"}
                              for name in datasets]},
        "tokenizer": info.as_dict(), "context_length": 32768,
        # The layout a run records (store/manifest.py): every line of each source has its committed row.
        "datasets": {name: {"rows": len(samples), "chat_template_kwargs": (template_kwargs or {}).get(name, {})}
                     for name, samples in datasets.items()},
    }
    storage.put("run.json", orjson.dumps(run))
    return built
