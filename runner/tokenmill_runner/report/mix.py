"""What a run's mix of datasets is made of: each dataset's share of the samples and of the loss tokens, prompts that
repeat within and across datasets, and prompts that overlap the evaluation sets the drafter will be judged on. Pure.

- **Shares** come from the commit markers and the loss-token counts (stats/token_freq.py).
- **Duplicates** are prompts whose *normalized content* is equal: every message's role and text and the tools, after
  Unicode NFKC, case folding and collapsing whitespace, hashed (BLAKE2b, 64 bits). A prompt with n samples is one
  prompt; two source lines with the same content are a duplicate, within a dataset or across two.
- **Evaluation overlap** is n-gram overlap, the decontamination rule of GPT-3 and its successors: a prompt overlaps an
  evaluation prompt when they share a run of `n` words (13 by default) after the same normalization, words being
  runs of letters and digits (`\\w+`; a script written without spaces makes long words, so overlap is found only on
  longer runs there). An evaluation prompt shorter than `n` words overlaps a prompt that holds all of its words in a
  row. A match is confirmed word for word, never by hash alone.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

NGRAM = 13
SHOWN = 10  # duplicate groups and overlapping samples named in report.json (the .jsonl files list every one)
_WORD = re.compile(r"\w+")
_SPACE = re.compile(r"\s+")
_BASE = np.uint64(0x100000001B3)  # the n-grams' polynomial hash over word hashes (FNV's prime)


def normalize(text: str) -> str:
    return _SPACE.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def content_text(content: Any) -> str:
    """A message's text: a string, the text parts of an OpenAI parts list, anything else as JSON."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(part.get("text", "") if isinstance(part, dict) else str(part) for part in content)
    return "" if content is None else orjson.dumps(content, option=orjson.OPT_SORT_KEYS).decode()


def prompt_text(messages: Sequence[dict[str, Any]], tools: Sequence[Any] | None = None) -> str:
    lines = [f"{message.get('role', '')}: {content_text(message.get('content'))}" for message in messages]
    if tools:
        lines.append("tools: " + orjson.dumps(list(tools), option=orjson.OPT_SORT_KEYS).decode())
    return "\n".join(lines)


def content_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(normalize(text).encode(), digest_size=8).digest(), "little")


def words(text: str) -> list[str]:
    return _WORD.findall(normalize(text))


def _gram_keys(hashes: np.ndarray, length: int) -> np.ndarray:
    """The hash of every run of `length` words, from the words' hashes (uint64 arithmetic wraps)."""
    count = hashes.size - length + 1
    keys = np.zeros(max(count, 0), dtype=np.uint64)
    if count <= 0:
        return keys
    with np.errstate(over="ignore"):
        for offset in range(length):
            keys = keys * _BASE + hashes[offset:offset + count]
    return keys


def _word_hashes(tokens: Sequence[str]) -> np.ndarray:
    # Python's string hash: salted per process, which is all that matters here (index and queries share one).
    return np.asarray([hash(token) & 0xFFFFFFFFFFFFFFFF for token in tokens], dtype=np.uint64)


@dataclass(frozen=True)
class EvalPrompt:
    file: str  # the evaluation file as the user named it
    line: int
    words: tuple[str, ...]


@dataclass(frozen=True)
class Overlap:
    eval_file: str
    eval_line: int
    ngram: str  # the shared words


@dataclass
class EvalIndex:
    """The n-grams of the evaluation prompts (evaluation sets are small: thousands of prompts)."""

    n: int = NGRAM
    prompts: list[EvalPrompt] = field(default_factory=list)
    too_short: int = 0  # evaluation prompts without a word
    _keys: dict[int, dict[int, list[tuple[int, int]]]] = field(default_factory=dict)  # length -> key -> (prompt, at)
    _sorted: dict[int, np.ndarray] = field(default_factory=dict)  # length -> its keys, sorted (built on first query)

    def add(self, file: str, line: int, text: str) -> None:
        tokens = tuple(words(text))
        if not tokens:
            self.too_short += 1
            return
        index = len(self.prompts)
        self.prompts.append(EvalPrompt(file, line, tokens))
        length = min(self.n, len(tokens))
        keys = _gram_keys(_word_hashes(tokens), length)
        table = self._keys.setdefault(length, {})
        self._sorted.clear()
        for at, key in enumerate(keys.tolist()):
            table.setdefault(key, []).append((index, at))

    def overlaps(self, text: str, limit: int = 3) -> list[Overlap]:
        """The evaluation prompts `text` overlaps (each once, at most `limit`)."""
        tokens = words(text)
        if not tokens or not self._keys:
            return []
        if not self._sorted:
            self._sorted = {length: np.sort(np.fromiter(table, dtype=np.uint64, count=len(table)))
                            for length, table in self._keys.items()}
        hashes = _word_hashes(tokens)
        found: dict[int, Overlap] = {}
        for length, table in self._keys.items():
            keys = _gram_keys(hashes, length)
            known = self._sorted[length]
            slot = np.minimum(np.searchsorted(known, keys), known.size - 1)
            hits = np.flatnonzero(known[slot] == keys)
            for position in hits.tolist():
                run = tuple(tokens[position:position + length])
                for index, at in table[int(keys[position])]:
                    prompt = self.prompts[index]
                    if index not in found and prompt.words[at:at + length] == run:
                        found[index] = Overlap(prompt.file, prompt.line, " ".join(run))
                if len(found) >= limit:
                    return list(found.values())
        return list(found.values())


@dataclass
class PromptHashes:
    """Each dataset's source lines and their normalized-content hashes, for the duplicate count."""

    lines: dict[str, np.ndarray] = field(default_factory=dict)  # dataset -> lines (int64)
    hashes: dict[str, np.ndarray] = field(default_factory=dict)  # dataset -> content hashes (uint64)

    def set(self, dataset: str, lines: Sequence[int], hashes: Sequence[int]) -> None:
        self.lines[dataset] = np.asarray(lines, dtype=np.int64)
        self.hashes[dataset] = np.asarray(hashes, dtype=np.uint64)


@dataclass(frozen=True)
class DuplicateGroup:
    content_hash: int
    members: tuple[tuple[str, int], ...]  # (dataset, line), datasets in spec order, lines ascending

    def record(self) -> dict[str, Any]:
        return {"content_hash": f"{self.content_hash:016x}",
                "lines": [{"dataset": dataset, "line": line} for dataset, line in self.members]}


def duplicate_groups(prompts: PromptHashes) -> list[DuplicateGroup]:
    """Every content that more than one source line holds, in the order of its first line."""
    names = list(prompts.hashes)
    if not names:
        return []
    hashes = np.concatenate([prompts.hashes[name] for name in names])
    which = np.concatenate([np.full(prompts.hashes[name].size, i, dtype=np.int64) for i, name in enumerate(names)])
    lines = np.concatenate([prompts.lines[name] for name in names])
    order = np.lexsort((lines, which, hashes))
    hashes, which, lines = hashes[order], which[order], lines[order]
    starts = np.flatnonzero(np.concatenate([[True], hashes[1:] != hashes[:-1]]))
    ends = np.concatenate([starts[1:], [hashes.size]])
    groups = [DuplicateGroup(int(hashes[start]), tuple((names[int(which[i])], int(lines[i])) for i in range(start, end)))
              for start, end in zip(starts.tolist(), ends.tolist(), strict=True) if end - start > 1]
    position = {name: i for i, name in enumerate(names)}
    return sorted(groups, key=lambda group: (position[group.members[0][0]], group.members[0][1]))


def duplicate_section(prompts: PromptHashes, groups: Sequence[DuplicateGroup]) -> dict[str, Any]:
    """Per dataset: prompts read, distinct contents, lines repeating an earlier line of the same dataset, and lines
    whose content another dataset also holds (per other dataset); the first groups."""
    per: dict[str, dict[str, Any]] = {
        name: {"prompts": int(prompts.lines[name].size), "distinct": int(np.unique(prompts.hashes[name]).size),
               "shared_with": {}} for name in prompts.lines}
    for counts in per.values():
        counts["repeated_within"] = counts["prompts"] - counts["distinct"]
    for group in groups:
        datasets = {dataset for dataset, _ in group.members}
        if len(datasets) < 2:
            continue
        for dataset, _ in group.members:
            shared = per[dataset]["shared_with"]
            for other in datasets - {dataset}:
                shared[other] = shared.get(other, 0) + 1
    across = sum(1 for group in groups if len({dataset for dataset, _ in group.members}) > 1)
    return {"datasets": per, "groups": len(groups), "groups_across_datasets": across,
            "first_groups": [group.record() for group in groups[:SHOWN]]}


@dataclass(frozen=True)
class OverlapMatch:
    dataset: str
    line: int
    sample_id: str
    overlaps: tuple[Overlap, ...]

    def record(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "line": self.line, "sample_id": self.sample_id,
                "overlaps": [{"eval_file": o.eval_file, "eval_line": o.eval_line, "ngram": o.ngram}
                             for o in self.overlaps]}


def overlap_section(index: EvalIndex, matches: Sequence[OverlapMatch], prompts: dict[str, int],
                    files: Sequence[str]) -> dict[str, Any]:
    """Per dataset: prompts that overlap an evaluation prompt (and their share), per evaluation file: its prompts
    that some training prompt overlaps."""
    per: dict[str, dict[str, Any]] = {name: {"prompts": count, "overlapping": 0, "share": None}
                                      for name, count in prompts.items()}
    hit: dict[str, set[int]] = {file: set() for file in files}
    for match in matches:
        per[match.dataset]["overlapping"] += 1
        for overlap in match.overlaps:
            hit[overlap.eval_file].add(overlap.eval_line)
    for counts in per.values():
        counts["share"] = counts["overlapping"] / counts["prompts"] if counts["prompts"] else None
    eval_prompts = {file: sum(1 for p in index.prompts if p.file == file) for file in files}
    return {"ngram": index.n, "eval_files": {file: {"prompts": eval_prompts[file], "overlapped": len(hit[file])}
                                             for file in files},
            "datasets": per, "matches": len(matches), "first_matches": [m.record() for m in matches[:SHOWN]]}


def share_section(samples: dict[str, int], loss_tokens: dict[str, float]) -> dict[str, Any]:
    """Each dataset's share of the committed samples and of the loss tokens."""
    total_samples, total_tokens = sum(samples.values()), sum(loss_tokens.values())
    return {name: {"samples": samples[name], "sample_share": samples[name] / total_samples if total_samples else None,
                   "loss_tokens": loss_tokens.get(name, 0),
                   "loss_token_share": loss_tokens.get(name, 0) / total_tokens if total_tokens else None}
            for name in samples}


def matched_lines(matches: Iterable[OverlapMatch]) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for match in matches:
        out.setdefault(match.dataset, set()).add(match.line)
    return out
