"""The measured trial's sample: the rows a trial candidate's runner sends first. Pure.

The operator's measured trial (docs/planning.md, "4d. A measured trial") runs each candidate layout a few minutes
and ranks them on what they generate. Measured on the job's own next prompts, the candidates would see different
parts of it: the first the longest-expected rows of the first dataset, a later one whatever follows, so a layout
could win on easier prompts. Each candidate's runner Job is therefore started with `--trial-sample`, and sends its
candidate's rows first, in the sample's order, then the rest of the job as usual (generate/pipeline.py).

The sample (`stratify`): each candidate gets its own rows, drawn from every dataset, so that each dataset's share of
the sample's output tokens is its share of the job's predicted output tokens (which makes the row counts
proportional to the datasets' sizes), at least MIN_PER_DATASET rows of each where it has them, in a seeded order
that interleaves the datasets. Every Job of one trial computes the samples from the same inputs (the seed, the
candidate count, the row count, the plan's output lengths and the datasets' rows counted by the scan), so the
candidates' samples are disjoint and each candidate is measured on prompts no other one generated. Nothing depends
on that for exactly-once: a row already settled is skipped, as in any resume.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

MIN_PER_DATASET = 3


@dataclass(frozen=True)
class DatasetShare:
    """One dataset as the sample sees it: its rows and its predicted mean output tokens."""

    name: str
    size: int
    mean_output_tokens: float


def allocate(datasets: Sequence[DatasetShare], per_candidate: int,
             min_per_dataset: int = MIN_PER_DATASET) -> dict[str, int]:
    """Rows of each dataset in one candidate's sample: the sample's output tokens split as the job's predicted
    output tokens are (so counts in proportion to the sizes), largest remainder, at least `min_per_dataset` where the
    dataset has them. The floor can make the total exceed `per_candidate`."""
    live = [d for d in datasets if d.size > 0]
    tokens = {d.name: d.size * max(d.mean_output_tokens, 1.0) for d in live}
    total_tokens = sum(tokens.values())
    if not live or per_candidate <= 0 or total_tokens <= 0:
        return {d.name: 0 for d in datasets}
    # Sample output tokens for dataset i: share_i x T; rows: that over its mean output.
    raw = {d.name: tokens[d.name] / total_tokens / max(d.mean_output_tokens, 1.0) for d in live}
    scale = per_candidate / sum(raw.values())
    exact = {n: v * scale for n, v in raw.items()}
    counts = {n: math.floor(v) for n, v in exact.items()}
    for n in sorted(exact, key=lambda n: (counts[n] - exact[n], n))[:per_candidate - sum(counts.values())]:
        counts[n] += 1
    sizes = {d.name: d.size for d in live}
    out = {d.name: 0 for d in datasets}
    for n, c in counts.items():
        out[n] = min(sizes[n], max(c, min_per_dataset))
    return out


def stratify(datasets: Sequence[DatasetShare], candidates: Sequence[str], per_candidate: int, seed: int | str = 0,
             min_per_dataset: int = MIN_PER_DATASET) -> dict[str, list[tuple[str, int]]]:
    """Each candidate's (dataset, row index) rows, in a seeded order interleaving the datasets. The candidates'
    samples are disjoint; a dataset too small for all of them gives each an equal part of what it has."""
    counts = allocate(datasets, per_candidate, min_per_dataset)
    k = max(1, len(candidates))
    samples: dict[str, list[tuple[str, int]]] = {c: [] for c in candidates}
    for d in datasets:
        want = counts.get(d.name, 0)
        if want <= 0 or not candidates:
            continue
        each = min(want, d.size // k) if d.size >= k else 0
        if each == 0 and d.size > 0:
            each = 1  # fewer rows than candidates: the first ones get one each
        rng = random.Random(f"{seed}:{d.name}")
        rows = rng.sample(range(d.size), min(d.size, each * k))
        for i, c in enumerate(candidates):
            samples[c].extend((d.name, r) for r in rows[i * each:(i + 1) * each])
    for i, c in enumerate(candidates):
        random.Random(f"{seed}:order:{i}").shuffle(samples[c])
    return samples


def mix(samples: Mapping[str, list[tuple[str, int]]]) -> dict[str, dict[str, int]]:
    """Per candidate, rows per dataset: the sample's composition."""
    out: dict[str, dict[str, int]] = {}
    for c, rows in samples.items():
        counts: dict[str, int] = {}
        for name, _ in rows:
            counts[name] = counts.get(name, 0) + 1
        out[c] = counts
    return out


@dataclass(frozen=True)
class SourceRows:
    """A dataset's rows as the scan counted them: `rows` rows on lines 1..lines, `skipped` a bool per line that
    yields no row (a JSONL source's blank lines; None: none), so row index i is the i-th line that yields one."""

    name: str
    rows: int
    skipped: np.ndarray | None = None

    def line_of(self, indices: Sequence[int]) -> list[int]:
        if self.skipped is None:
            return [i + 1 for i in indices]
        lines = np.flatnonzero(~self.skipped) + 1
        return [int(lines[i]) for i in indices]


def first_lines(seed: str, candidate: int, candidates: int, prompts: int, output_tokens: Mapping[str, float],
                sources: Sequence[SourceRows]) -> dict[str, dict[int, int]]:
    """Candidate `candidate`'s rows (of `candidates`, `prompts` each) as each dataset's {line: position in the
    sample's order}. A dataset the plan gave no output length counts at the mean of the others' (the allocation
    needs a weight, not an exact figure)."""
    given = [v for v in output_tokens.values() if v > 0]
    default = sum(given) / len(given) if given else 1.0
    shares = [DatasetShare(s.name, s.rows, output_tokens.get(s.name) or default) for s in sources]
    names = [str(i) for i in range(candidates)]
    rows = stratify(shares, names, prompts, seed)[names[candidate]]
    by_name = {s.name: s for s in sources}
    out: dict[str, dict[int, int]] = {s.name: {} for s in sources}
    indices: dict[str, list[tuple[int, int]]] = {}
    for position, (name, index) in enumerate(rows):
        indices.setdefault(name, []).append((position, index))
    for name, pairs in indices.items():
        lines = by_name[name].line_of([index for _, index in pairs])
        out[name] = {line: position for (position, _), line in zip(pairs, lines, strict=True)}
    return out
