"""The report's draft-vocabulary section: how much of the loss tokens the K most frequent ids cover, per dataset and for
the run's mix, at the sizes drafters use, and how many ids each share needs. Pure.

Coverage at K is the ceiling a draft vocabulary of K ids puts on acceptance: a target token outside it can never be
proposed. The figures are exact (integer counts over every committed slot, store/token_counts.py); the mix is the
datasets in the run's own proportions (`tokenmill export --format vocab --weight` builds other mixes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..stats.token_freq import REPORT_SIZES, SHARES, TokenFrequencies

RULE = ("loss-bearing tokens: the ids the target generated in each generation, the stop token included (the loss "
        "mask's 1s in the token exports)")


def mixed(frequencies: Mapping[str, TokenFrequencies], weights: Mapping[str, float] | None = None) -> TokenFrequencies:
    """The datasets merged in the order given (spec order), each times its weight (1 when not named)."""
    mix = TokenFrequencies()
    for name, counts in frequencies.items():
        mix.merge(counts, (weights or {}).get(name, 1))
    return mix


def frequency_figures(counts: TokenFrequencies, sizes: Sequence[int] = REPORT_SIZES) -> dict[str, Any]:
    total = counts.total
    covered = counts.covered(sizes)
    return {"loss_tokens": total, "distinct_ids": counts.distinct,
            "covered_tokens": {str(size): covered[size] for size in sizes},
            "coverage": {str(size): covered[size] / total if total else None for size in sizes},
            "ids_for_share": {str(share): ids for share, ids in counts.ids_for(SHARES).items()}}


def vocabulary_section(frequencies: Mapping[str, TokenFrequencies], sizes: Sequence[int] = REPORT_SIZES,
                       uncounted: Mapping[str, int] | None = None) -> dict[str, Any]:
    """`uncounted`: per dataset, shards left out (the operator's report recounts no shard from its rows: a slot
    committed twice, or markers written before the counts); the figures are then of the shards counted."""
    uncounted = uncounted or {}
    return {"rule": RULE, "sizes": list(sizes), "exact": not any(uncounted.values()),
            "datasets": {name: {**frequency_figures(counts, sizes), "shards_not_counted": uncounted.get(name, 0)}
                         for name, counts in frequencies.items()},
            "mix": {"datasets": list(frequencies), **frequency_figures(mixed(frequencies), sizes)}}
