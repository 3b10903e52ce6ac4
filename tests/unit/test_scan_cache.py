"""A resume does not pay the counting pass again: the scan is cached in the output, keyed by the source's identity."""

from __future__ import annotations

import os

import orjson
import pytest

from tokenmill_runner.source import scan_cache
from tokenmill_runner.source.adapters import RowLayout
from tokenmill_runner.source.length_key import ANSWER_CODES, CODES, length_code
from tokenmill_runner.source.line_codes import LineCodes
from tokenmill_runner.source.prompts import Prompt, RowError, belongs_to_worker, id_hash
from tokenmill_runner.source.reader import read_prompts
from tokenmill_runner.source.scan_cache import cached_scan
from tokenmill_runner.store.storage import LocalStorage


def write_source(path, ids: list[str | None]) -> None:
    lines = [orjson.dumps({"sample_id": i, "messages": [{"role": "user", "content": f"q {n}"}]}) if i is not None
             else b"{broken" for n, i in enumerate(ids)]
    path.write_bytes(b"\n".join(lines) + b"\n")


@pytest.fixture
def scans(monkeypatch):
    """How many times the source was really scanned."""
    calls = []
    real = scan_cache.scan_source

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(scan_cache, "scan_source", counting)
    return calls


def test_the_scan_is_reused_until_the_source_changes(tmp_path, scans):
    source = tmp_path / "p.jsonl"
    write_source(source, ["a", "b", "a", None, "c"])
    out = LocalStorage(tmp_path / "out")
    first = cached_scan(out, "p", str(source), "jsonl")
    again = cached_scan(out, "p", str(source), "jsonl")
    assert len(scans) == 1, "the second start read the cached result"
    assert (again.rows, again.worker_rows, len(again.duplicates)) == (first.rows, first.worker_rows, 1) == (5, 5, 1)
    assert again.duplicates.first_of(3, int(first.duplicates.hashes[0])) == 1

    write_source(source, ["a", "b", "c", "d", "e", "f"])
    os.utime(source, ns=(1, 1))  # even with an old mtime: the size changed
    changed = cached_scan(out, "p", str(source), "jsonl")
    assert len(scans) == 2 and changed.rows == 6 and len(changed.duplicates) == 0
    assert cached_scan(out, "p", str(source), "jsonl", limit=3).rows == 3 and len(scans) == 3, "the limit is keyed"


def test_a_torn_cache_is_ignored_and_replaced(tmp_path, scans):
    source = tmp_path / "p.jsonl"
    write_source(source, ["a", "b"])
    out = LocalStorage(tmp_path / "out")
    cached_scan(out, "p", str(source), "jsonl")
    [key] = [key for key in out.list("p/scans/") if key.endswith(".scan")]
    out.put(key, out.get(key)[:-3])
    assert cached_scan(out, "p", str(source), "jsonl").rows == 2 and len(scans) == 2
    assert cached_scan(out, "p", str(source), "jsonl").rows == 2 and len(scans) == 2, "rewritten whole"


def test_each_worker_caches_the_lines_it_owns(tmp_path, scans):
    source = tmp_path / "p.jsonl"
    ids = [f"id{n}" for n in range(200)]
    ids[17] = None  # a bad row: owned by its line number
    write_source(source, ids)
    out = LocalStorage(tmp_path / "out")
    owned = []
    for worker in range(3):
        scan = cached_scan(out, "p", str(source), "jsonl", worker_index=worker, worker_count=3)
        expected = {item.line for item in read_prompts(str(source), "jsonl") if belongs_to_worker(item, worker, 3)}
        assert {line for line in range(1, 201) if scan.owns(line)} == expected
        assert cached_scan(out, "p", str(source), "jsonl", worker_index=worker, worker_count=3).owned.to_array() \
            .tobytes() == scan.owned.to_array().tobytes()
        owned.append(expected)
    assert set().union(*owned) == set(range(1, 201)) and sum(map(len, owned)) == 200, "no gap, no overlap"
    assert len(scans) == 3


def test_rows_not_wanted_are_never_parsed(tmp_path):
    source = tmp_path / "p.jsonl"
    write_source(source, ["a", None, "c", "d"])
    wanted = read_prompts(str(source), "jsonl", wanted=lambda line: line != 2)
    assert [(type(item), item.line) for item in wanted] == [(Prompt, 1), (Prompt, 3), (Prompt, 4)]
    everything = list(read_prompts(str(source), "jsonl"))
    assert isinstance(everything[1], RowError) and everything[1].reason == "invalid_json"
    assert [item.line for item in read_prompts(str(source), "jsonl", limit=2, wanted=lambda line: line != 1)] == [2]


def write_shard(path, ids: list[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"sample_id": ids, "prompt": [f"q {i}" for i in ids]}), path)


def test_a_dataset_folder_is_read_shard_after_shard_and_keyed_by_every_shard(tmp_path, scans):
    # Hugging Face layout (data/train-0000k-of-0000n.parquet): names in order, line numbers continuing.
    folder = tmp_path / "hf"
    write_shard(folder / "data" / "train-00001-of-00002.parquet", ["d", "a"])
    write_shard(folder / "data" / "train-00000-of-00002.parquet", ["a", "b", "c"])
    assert [(p.line, p.sample_id) for p in read_prompts(str(folder), "parquet")] == \
        [(1, "a"), (2, "b"), (3, "c"), (4, "d"), (5, "a")]
    assert [p.line for p in read_prompts(str(folder), "parquet", limit=4)] == [1, 2, 3, 4]
    out = LocalStorage(tmp_path / "out")
    scan = cached_scan(out, "p", str(folder), "parquet")
    assert scan.rows == 5 and scan.duplicates.first_of(5, id_hash("a")) == 1 and len(scans) == 1
    assert cached_scan(out, "p", str(folder), "parquet").rows == 5 and len(scans) == 1
    write_shard(folder / "data" / "train-00002-of-00002.parquet", ["e"])  # another shard: another identity
    assert cached_scan(out, "p", str(folder), "parquet").rows == 6 and len(scans) == 2
    write_shard(folder / "data" / "train-00000-of-00002.parquet", ["a"])  # a shard rewritten
    assert cached_scan(out, "p", str(folder), "parquet").rows == 4 and len(scans) == 3
    # The same rows read through another layout are another scan (other valid rows, other ids).
    cached_scan(out, "p", str(folder), "parquet", layout=RowLayout(format="prompt", id="prompt"))
    assert len(scans) == 4


def test_a_folder_without_shards_says_where_it_looked(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty: a folder without \*.parquet or data/\*.parquet shards"):
        list(read_prompts(str(tmp_path / "empty"), "parquet"))


def test_the_counting_pass_keeps_each_lines_length_code_for_the_whole_jobs_order(tmp_path, scans):
    """Issue 44: the scan records a code per line (the earlier answer's length in doublings, else the prompt's
    class; 0 for a line this worker does not generate), cached beside it and read back in line order."""
    rows = [{"sample_id": "a", "messages": [{"role": "user", "content": "q"},
                                            {"role": "assistant", "content": "x" * 4000}]},  # ~1,000 tokens
            {"sample_id": "b", "messages": [{"role": "user", "content": "y" * 2000}]},  # a 500-token prompt
            None, {"sample_id": "c", "messages": [{"role": "user", "content": "z"}]}]
    source = tmp_path / "p.jsonl"
    source.write_bytes(b"\n".join(orjson.dumps(row) if row else b"{broken" for row in rows) + b"\n\n")
    out = LocalStorage(tmp_path / "out")
    scan = cached_scan(out, "p", str(source), "jsonl")
    expected = [length_code(rows[0]["messages"], 4001), 2, 0, 1]
    assert expected[0] == ANSWER_CODES + 4 * 9 + 3 - 12  # 1,000 tokens: 2^9.97, the 39th quarter doubling
    codes = LineCodes(out.open_read(scan.codes))
    assert [codes.code(line) for line in (1, 2, 3, 4, 5, 9)] == [*expected, 0, 0]
    histogram = [0] * CODES
    for code in (expected[0], 2, 1):
        histogram[code] += 1
    assert scan.length_codes == tuple(histogram)
    again = cached_scan(out, "p", str(source), "jsonl")
    assert len(scans) == 1 and again.length_codes == scan.length_codes and again.codes == scan.codes
