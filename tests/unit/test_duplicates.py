"""Duplicate sample ids found from the whole source with bounded memory, independent of what was committed."""

from __future__ import annotations

import random
from collections import defaultdict

import numpy as np
import orjson

from tokenmill_runner.source import scan
from tokenmill_runner.source.duplicates import PAIR, DuplicateIds, repeated_ids
from tokenmill_runner.source.prompts import id_hash
from tokenmill_runner.source.scan import PairSpool, scan_source


def pairs(items: list[tuple[int, int]]) -> np.ndarray:
    array = np.empty(len(items), PAIR)
    array["hash"] = [h for h, _ in items]
    array["line"] = [line for _, line in items]
    return array


def test_repeated_ids_are_those_on_several_lines_with_their_first_line():
    hashes, lines = repeated_ids(pairs([(7, 9), (3, 1), (7, 4), (5, 2), (7, 8), (3, 6), (2**64 - 1, 3)]))
    assert hashes.tolist() == [3, 7] and lines.tolist() == [1, 4]
    found = DuplicateIds(hashes, lines)
    assert found.first_of(4, 7) is None, "the first line with an id is generated"
    assert found.first_of(9, 7) == 4 and found.first_of(6, 3) == 1
    assert found.first_of(2, 5) is None and found.first_of(3, 2**64 - 1) is None
    assert len(DuplicateIds.from_buckets([])) == 0 and repeated_ids(pairs([]))[0].size == 0


def test_the_spool_finds_the_same_duplicates_as_a_dict_across_flushes_and_buckets(tmp_path, monkeypatch):
    monkeypatch.setattr(scan, "FLUSH_ROWS", 1000)  # many flushes, so pairs of one id land in several writes
    rng = random.Random(7)
    ids = [f"id-{rng.randrange(40_000)}" for _ in range(30_000)]  # plenty of repeats, far apart
    spool = PairSpool(tmp_path)
    lines_of: dict[int, list[int]] = defaultdict(list)
    for line, sample_id in enumerate(ids, start=1):
        spool.add(id_hash(sample_id), line)
        lines_of[id_hash(sample_id)].append(line)
    found = spool.resolve()
    expected = {key: lines[0] for key, lines in lines_of.items() if len(lines) > 1}
    assert len(found) == len(expected) > 1000
    assert dict(zip(found.hashes.tolist(), found.first_lines.tolist(), strict=True)) == expected
    assert len(list(tmp_path.glob("ids-*.bin"))) == scan.BUCKETS, "every bucket holds pairs"


def test_scan_counts_rows_and_finds_duplicates_of_valid_rows_only(tmp_path):
    rows: list[bytes] = []
    for line in range(1, 1001):
        if line == 900:
            row = {"sample_id": "s0005", "messages": [{"role": "user", "content": "again"}]}  # duplicate of line 5
        elif line == 300:
            row = {"sample_id": "s0700", "messages": []}  # invalid: does not make line 700 a duplicate
        else:
            row = {"sample_id": f"s{line:04d}", "messages": [{"role": "user", "content": f"q{line}"}]}
        rows.append(orjson.dumps(row))
    rows.insert(10, b"")  # a blank line: skipped, and later lines keep their numbers
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n".join(rows) + b"\n")
    found = scan_source(str(path), "jsonl")
    assert (found.rows, found.worker_rows) == (1000, 1000)
    assert found.duplicates.first_of(901, id_hash("s0005")) == 5  # line 900 moved to 901 by the blank line
    assert found.duplicates.first_of(5, id_hash("s0005")) is None
    assert found.duplicates.first_line(id_hash("s0700")) is None and len(found.duplicates) == 1
    limited = scan_source(str(path), "jsonl", limit=500)
    assert limited.rows == 500 and len(limited.duplicates) == 0


def test_scan_splits_rows_by_worker_and_duplicates_meet_in_one(tmp_path):
    rows = [{"sample_id": f"s{i % 700}", "messages": [{"role": "user", "content": "x"}]} for i in range(1000)]
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    scans = [scan_source(str(path), "jsonl", worker_index=i, worker_count=3) for i in range(3)]
    assert sum(s.worker_rows for s in scans) == 1000 and all(s.rows == 1000 for s in scans)
    assert sum(len(s.duplicates) for s in scans) == 300  # ids s0..s299 occur twice, each in one worker
