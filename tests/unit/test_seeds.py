"""Seeds per slot, attempt, retry round and turn: reproducible, and never replayed where a replay would repeat the
failure (review 9)."""

from __future__ import annotations

import hashlib

from tokenmill_runner.generate.seeds import SEED_BITS, sample_seed


def test_a_slot_s_first_attempt_keeps_the_seed_earlier_runs_recorded():
    digest = hashlib.blake2b(b"0|B5|17|2", digest_size=8).digest()
    assert sample_seed(None, "B5", 17, 2) == int.from_bytes(digest, "little") & ((1 << SEED_BITS) - 1)


def test_attempts_retry_rounds_and_turns_each_draw_with_another_seed_reproducibly():
    seeds = {sample_seed(7, "d", 3, 1, attempt, retry_round, turn)
             for attempt in range(3) for retry_round in range(2) for turn in range(3)}
    assert len(seeds) == 18
    assert sample_seed(7, "d", 3, 1, attempt=2, turn=1) == sample_seed(7, "d", 3, 1, attempt=2, turn=1)
    assert all(0 <= seed < 2 ** 31 for seed in seeds)
