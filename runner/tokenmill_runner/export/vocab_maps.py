"""Draft-vocabulary maps from loss-token frequencies, each trainer's way. Pure.

Both trainers keep the `size` target ids a drafter may propose, sorted ascending, as `d2t[i] = ids[i] - i` (the
offset to add to a draft index) and `t2d` (a bool per target id); they differ in which ids they keep when counts tie
at the cut, and in how they fill up a vocabulary larger than the ids counted:

- speculators 0.9.0 (`SP` speculators/train/vocab_mapping.py:74-106, `build_vocab_mappings_from_distribution`):
  ids sorted by (-count, id); fewer than `size` counted: the smallest ids of range(size) not chosen are added.
- SpecForge 0.2.0 (`SF` specforge/data/preprocessing.py:720-770, `process_token_dict_to_mappings`): a Counter filled
  record by record (each record's distinct ids ascending, SF :616-625 and training/vocab_mapping.py:36-63), so
  `most_common(size)` keeps tied ids in the order they first appeared; fewer than `size` counted: it adds ids of
  `set(range(size)) - counted` with count 0, in the order Python iterates that set, until it holds `size` ids.
- SGLang 0.5.23 (`sglang/srt/speculative/spec_utils.py:792-819`): `--speculative-token-map` is `torch.load` of a
  list of hot target ids, made an int64 tensor; the draft's head keeps those rows, draft index i proposing
  hot[i]. Written most frequent first (ties by id), as FR-Spec's published maps are. SGLang ignores it for EAGLE3
  drafters, which carry d2t (eagle_worker_v2.py:323-334): it serves EAGLE and EAGLE-2 drafters.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..stats.token_freq import TokenFrequencies


class VocabError(ValueError):
    """A map that cannot be built: the message names the size or the id."""


@dataclass(frozen=True)
class DraftVocab:
    """The kept ids (ascending) and the maps both trainers load."""

    ids: np.ndarray  # int64, ascending, `size` of them
    target_vocab_size: int

    @property
    def d2t(self) -> np.ndarray:
        return self.ids - np.arange(self.ids.size, dtype=np.int64)

    @property
    def t2d(self) -> np.ndarray:
        mask = np.zeros(self.target_vocab_size, dtype=np.bool_)
        mask[self.ids] = True
        return mask


def _checked(frequencies: TokenFrequencies, size: int, target_vocab_size: int) -> None:
    if size < 1:
        raise VocabError(f"a draft vocabulary size must be positive, got {size}")
    if size > target_vocab_size:
        raise VocabError(f"draft vocabulary size {size} is larger than the target's vocabulary ({target_vocab_size})")
    counted = np.flatnonzero(frequencies.counts)
    if counted.size and counted[-1] >= target_vocab_size:
        raise VocabError(f"token id {int(counted[-1])} was generated but the target's vocabulary has "
                         f"{target_vocab_size} ids: set --target-vocab-size to the model's config.json vocab_size")


def _finish(chosen: list[int], target_vocab_size: int) -> DraftVocab:
    return DraftVocab(np.sort(np.asarray(chosen, dtype=np.int64)), target_vocab_size)


def ranked_ids(frequencies: TokenFrequencies, size: int, target_vocab_size: int) -> list[int]:
    """The `size` ids speculators keeps, most frequent first, ties by ascending id; fewer counted: the smallest ids
    not counted fill it up (SP vocab_mapping.py:81-94). SGLang's hot-token list, as written."""
    _checked(frequencies, size, target_vocab_size)
    chosen: list[int] = frequencies.by_count()[:size].tolist()
    if len(chosen) < size:
        have = set(chosen)
        chosen += [tid for tid in range(size) if tid not in have][:size - len(chosen)]
    return chosen


def speculators_vocab(frequencies: TokenFrequencies, size: int, target_vocab_size: int) -> DraftVocab:
    return _finish(ranked_ids(frequencies, size, target_vocab_size), target_vocab_size)


def specforge_vocab(frequencies: TokenFrequencies, size: int, target_vocab_size: int) -> DraftVocab:
    _checked(frequencies, size, target_vocab_size)
    seen = frequencies.seen()
    counts = frequencies.counts[seen]
    if seen.size >= size:
        # Stable: equal counts keep the order the ids first appeared in.
        return _finish(seen[np.argsort(-counts, kind="stable")][:size].tolist(), target_vocab_size)
    chosen = seen.tolist()
    for tid in set(range(size)) - set(chosen):  # SF's own set, iterated as Python iterates it
        chosen.append(tid)
        if len(chosen) >= size:
            break
    return _finish(chosen, target_vocab_size)


def token_freq_dict(frequencies: TokenFrequencies) -> dict[int, int | float]:
    """speculators' token_freq.pt: {id: count} over the ids counted (SP vocab_mapping.py:44-56), ascending ids."""
    ids = np.flatnonzero(frequencies.counts)
    values = frequencies.counts[ids].tolist()
    return dict(zip(ids.tolist(), values, strict=True))
