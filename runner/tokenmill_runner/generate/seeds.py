"""Per-sample seeds: the same spec gives every sample the same seed on every run, on every machine. Pure.

A sample is a slot (dataset, line, sample index); its seed is a hash of the spec's seed base and the slot, so it
does not depend on the resource's name, the worker split, the order samples run in, or how often a run restarts.
An attempt after a failed one, a `--retry-failed` round and each turn of a conversation get seeds of their own
(`|a<attempt>`, `|r<round>`, `|t<turn>` appended when not 0; a given-up slot runs in the round after the last one it
failed in, which its failure records carry as `retry_round`): under --enable-deterministic-inference SGLang's draw
is a function of the seed and the position, so a NaN would repeat on every retry with one seed, and turns whose
output positions overlap would share their noise. The row records the seed that produced it (a turn its own).
Python's hash() is salted per process, so blake2b is used. 31 bits: every supported SGLang release accepts it (the
per-request seed tensor is int32 in 0.5.6, int64 from 0.5.7, docs/sglang-release-facts.md D.4).
"""

from __future__ import annotations

import hashlib

SEED_BITS = 31
DEFAULT_SEED_BASE = 0
SEED_RULE = ("blake2b(f'{seed_base}|{dataset}|{line}|{sample_index}' + ('|a{attempt}' if attempt) + "
             "('|r{round}' if round) + ('|t{turn}' if turn), digest_size=8) little-endian & (2**31 - 1)")


def sample_seed(seed_base: int | None, dataset: str, line: int, sample_index: int, attempt: int = 0,
                retry_round: int = 0, turn: int = 0) -> int:
    base = DEFAULT_SEED_BASE if seed_base is None else seed_base
    key = f"{base}|{dataset}|{line}|{sample_index}"
    for tag, value in (("a", attempt), ("r", retry_round), ("t", turn)):
        if value:
            key += f"|{tag}{value}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << SEED_BITS) - 1)


def seed_rule(seed_base: int | None) -> dict[str, object]:
    """What run.json records, enough to recompute any sample's seed."""
    return {"base": DEFAULT_SEED_BASE if seed_base is None else seed_base, "rule": SEED_RULE}
