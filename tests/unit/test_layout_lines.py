"""The layout is the set of lines a source yields, and a source's identity is all of its bytes (issue 29, items 6
and 7): the scan records the last line, the blank lines below it and a hash of every byte; completeness counts only
the lines that yield a row; run.json keeps the blank lines compactly and reads them back bounded."""

from __future__ import annotations

import gzip
import hashlib
import zlib
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenmill_runner.source.scan import scan_source
from tokenmill_runner.store.ledger import DatasetLedger
from tokenmill_runner.store.manifest import DatasetLayout, ManifestError, SourceIdentity, decode_lines, encode_lines


def marker(lines: list[int], failed: list[int] | None = None) -> dict:
    failed = failed or []
    return {"shard_id": "w000-a-0", "samples": {"line": lines, "sample_index": [0] * len(lines),
                                                "completion_tokens": [5] * len(lines)},
            "failed": {"line": failed, "sample_index": [0] * len(failed), "reason": ["bad_row"] * len(failed)}}


def test_a_blank_line_is_no_slot_and_the_last_line_is_in_the_layout():
    # 40 rows on lines 1-10 and 12-41: counting rows (40) left line 41 outside and line 11 missing for ever.
    rows = [*range(1, 11), *range(12, 42)]
    ledger = DatasetLedger("d", 41).fold_all([marker(rows[:-1], [rows[-1]])])
    within = np.ones(41, dtype=bool)
    within[10] = False
    part = ledger.completeness(41, 1, within)
    assert part.settled and (part.slots, part.generated, part.failures, part.skipped) == (40, 39, {"bad_row": 1}, 1)
    old = ledger.completeness(40, 1)  # what the layout said before: rows as lines
    assert not old.settled and old.missing == 1 and old.outside == 1
    lacking = DatasetLedger("d", 41).fold_all([marker(rows[:-2])]).completeness(41, 1, within)
    assert lacking.missing == 2 and "2 of 40 slots have no outcome (40 lines" in lacking.describe_missing()


def test_outcomes_on_a_line_outside_the_layout_are_counted_apart():
    within = np.array([True, False, True])
    part = DatasetLedger("d", 3).fold_all([marker([1, 2, 3])]).completeness(3, 1, within)
    assert (part.generated, part.outside, part.missing) == (2, 1, 0)


def test_skipped_lines_round_trip_through_run_json_and_are_read_back_bounded():
    skipped = np.zeros(10_000_000, dtype=bool)
    skipped[1::2] = True  # a double-spaced file of ten million lines
    text = encode_lines(skipped)
    assert len(text) < 100_000
    layout = DatasetLayout(rows=5_000_000, lines=10_000_000, skipped=text, skipped_lines=5_000_000)
    back = DatasetLayout.model_validate(orjson.loads(orjson.dumps(layout.model_dump(mode="json"))))
    within = back.within()
    assert within is not None and within.size == 10_000_000 and int(within.sum()) == 5_000_000 and within[0]
    assert back.completeness(None).slots == 5_000_000
    # A hostile run.json cannot make a reader inflate more than lines/8 bytes.
    bomb = __import__("base64").b64encode(zlib.compress(b"\xff" * 100_000_000, 9)).decode()
    assert decode_lines(bomb, 80).size == 80 and decode_lines(bomb, 80).all()
    with pytest.raises(ManifestError, match="skipped lines"):
        decode_lines("not base64!", 8)
    assert DatasetLayout(rows=7).within() is None and DatasetLayout(rows=7).last_line == 7


def test_the_scan_hashes_every_byte_and_records_the_blank_lines(tmp_path: Path):
    lines = [orjson.dumps({"sample_id": f"s{i}", "messages": [{"role": "user", "content": f"q {i}"}]})
             for i in range(6)]
    body = b"\n".join([lines[0], b"", lines[1], b"   ", lines[2], *lines[3:]]) + b"\n"
    path = tmp_path / "p.jsonl.gz"
    path.write_bytes(gzip.compress(body))
    scan = scan_source(str(path), "jsonl")
    assert (scan.rows, scan.lines) == (6, 8)
    assert scan.skipped is not None and scan.skipped.mask(8).tolist() == [False, True, False, True] + [False] * 4
    assert scan.content_hash == hashlib.blake2b(path.read_bytes(), digest_size=32).hexdigest()
    limited = scan_source(str(path), "jsonl", limit=2)
    assert (limited.rows, limited.lines) == (2, 3), "the layout ends at the limit's last row"
    assert limited.content_hash == scan.content_hash, "the identity is of the whole file, past the limit"
    plain = tmp_path / "q.jsonl"
    plain.write_bytes(b"\n".join(lines) + b"\n")
    whole = scan_source(str(plain), "jsonl")
    assert whole.skipped is None and whole.lines == 6 and whole.worker_lines() is None


def test_a_parquet_folder_is_hashed_shard_by_shard(tmp_path: Path):
    folder = tmp_path / "ds"
    folder.mkdir()
    for shard in range(2):
        table = pa.table({"sample_id": [f"s{shard}-{i}" for i in range(3)],
                          "messages": [[{"role": "user", "content": f"q {shard} {i}"}] for i in range(3)]})
        pq.write_table(table, folder / f"train-{shard}.parquet")
    before = scan_source(str(folder), "parquet", limit=2)
    assert (before.rows, before.lines, before.skipped) == (2, 2, None)
    table = pa.table({"sample_id": ["x"], "messages": [[{"role": "user", "content": "another"}]]})
    pq.write_table(table, folder / "train-1.parquet")  # a shard past the limit changed
    assert scan_source(str(folder), "parquet", limit=2).content_hash != before.content_hash


def test_a_source_of_the_same_size_and_head_differs_by_its_content_hash():
    recorded = SourceIdentity(uri="s3://b/p.jsonl", size=100, head_hash="h", content_hash="aaaa")
    edited = recorded.model_copy(update={"content_hash": "bbbb", "version": "another etag"})
    assert "hash of all its bytes differs" in (recorded.differs(edited) or "")
    reuploaded = recorded.model_copy(update={"version": "another etag"})
    assert recorded.differs(reuploaded) is None
    older = recorded.model_copy(update={"content_hash": None})  # a run.json from before content hashes
    assert older.differs(edited) is None
