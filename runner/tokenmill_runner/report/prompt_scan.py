"""The prompt sources of a run, read once for the mix report: each line's normalized-content hash (duplicates) and its
overlap with the evaluation files the user names (report/mix.py has the rules). The storage edge of `mix.py`.

The sources are the ones run.json records (each dataset's source, format, input mapping and limit), read as the
runner reads them (`source.reader.read_prompts`): the same lines, the same messages. Evaluation files are JSON lines
of prompts, each line read bounded (`EVAL_LINE_BYTES`) before it is parsed: a JSON string, an object with
`messages` (chat messages) or `turns` (MT-Bench's list of user turns), or an object with one of `EVAL_TEXT_KEYS`.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..source.prompts import Prompt
from ..source.reader import OversizeLine, read_jsonl, read_prompts, source_format
from ..spec.resource import DatasetSpec
from .mix import NGRAM, EvalIndex, OverlapMatch, PromptHashes, content_hash, content_text, prompt_text

logger = logging.getLogger(__name__)

EVAL_LINE_BYTES = 4 * 1024 * 1024
EVAL_TEXT_KEYS = ("prompt", "question", "instruction", "problem", "input", "text", "query", "content")


class EvalFileError(ValueError):
    """An evaluation file that is not JSON lines of prompts; the message names the file and the line."""


def eval_text(record: Any, where: str) -> str:
    if isinstance(record, str):
        return record
    if isinstance(record, dict):
        if isinstance(record.get("messages"), list):
            return prompt_text([m for m in record["messages"] if isinstance(m, dict)])
        if isinstance(record.get("turns"), list):
            return "\n".join(content_text(turn) for turn in record["turns"])
        for key in EVAL_TEXT_KEYS:
            if isinstance(record.get(key), str):
                return str(record[key])
    raise EvalFileError(f"{where}: not a prompt (a JSON string, or an object with messages, turns or one of "
                        f"{', '.join(EVAL_TEXT_KEYS)})")


def read_eval_files(files: Sequence[str], n: int = NGRAM, endpoint: str | None = None) -> EvalIndex:
    index = EvalIndex(n)
    for file in files:
        for line, raw in read_jsonl(file, endpoint, max_bytes=EVAL_LINE_BYTES):
            where = f"{file}:{line}"
            if isinstance(raw, OversizeLine):
                raise EvalFileError(f"{where} is {raw.size} bytes, over the {EVAL_LINE_BYTES} an evaluation prompt "
                                    "may have")
            try:
                record = orjson.loads(raw)
            except orjson.JSONDecodeError as error:
                raise EvalFileError(f"{where} is not JSON ({error})") from None
            index.add(file, line, eval_text(record, where))
    return index


@dataclass
class PromptScan:
    hashes: PromptHashes = field(default_factory=PromptHashes)
    matches: list[OverlapMatch] = field(default_factory=list)
    index: EvalIndex | None = None

    def prompts(self) -> dict[str, int]:
        return {name: int(lines.size) for name, lines in self.hashes.lines.items()}


def dataset_specs(run: dict[str, Any]) -> list[DatasetSpec]:
    return [DatasetSpec.model_validate(d) for d in (run.get("spec") or {}).get("datasets", [])]


def _prompts(spec: DatasetSpec, endpoint: str | None) -> Iterator[Prompt]:
    fmt = source_format(spec.source, spec.format, endpoint)
    for item in read_prompts(spec.source, fmt, endpoint, spec.limit, layout=spec.row_layout()):
        if isinstance(item, Prompt):  # a row the runner refused has no prompt to compare
            yield item


def scan_prompts(run: dict[str, Any], datasets: Sequence[str], index: EvalIndex | None,
                 endpoint: str | None = None) -> PromptScan:
    """Every selected dataset's prompts read once: their content hashes and, with an index, their overlaps."""
    scan = PromptScan(index=index)
    wanted = set(datasets)
    for spec in dataset_specs(run):
        if spec.name not in wanted:
            continue
        lines, hashes = array("q"), array("Q")  # 16 bytes a prompt, never an object per line
        for prompt in _prompts(spec, endpoint):
            text = prompt_text(prompt.messages, prompt.tools)
            lines.append(prompt.line)
            hashes.append(content_hash(text))
            if index is not None:
                overlaps = index.overlaps(text)
                if overlaps:
                    scan.matches.append(OverlapMatch(spec.name, prompt.line, prompt.sample_id, tuple(overlaps)))
        scan.hashes.set(spec.name, lines, hashes)
        logger.info("%s: %d prompts read from %s", spec.name, len(lines), spec.source)
    return scan
