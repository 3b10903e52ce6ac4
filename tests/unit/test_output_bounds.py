"""Every bound a reader of an output holds what it reads to (store/bounds.py, docs/security.md "What a reader takes
from an output"), at the bound and just past it. The audit's reproductions are tests/integration/test_output_reads.py.
"""

from __future__ import annotations

import gc
import os
from datetime import UTC, datetime
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenmill_runner.source.scan_cache import decode_scan
from tokenmill_runner.store import checkpoints, index_store, ledger, markers, parquet_rows, seals, shards
from tokenmill_runner.store.bounded_get import ObjectTooLarge, get_bounded
from tokenmill_runner.store.bounds import MAX_DATASETS, MAX_SLOTS, OverBound, check_values, json_values
from tokenmill_runner.store.checkpoints import OPERATOR_WRITER, RUNNER, Signer, max_raw
from tokenmill_runner.store.commit_index import DatasetIndex
from tokenmill_runner.store.hidden_states import expected_lengths
from tokenmill_runner.store.ledger import DatasetLedger, LedgerBudget, ShardContent, Slot, build_marker
from tokenmill_runner.store.manifest import MANIFEST_VALUES, DatasetLayout, ManifestError, decode, encode_lines
from tokenmill_runner.store.packed import HEADER_BYTES, PackError, pack, unpack
from tokenmill_runner.store.storage import LocalStorage, StorageError

from .counting_storage import commit_lines

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def manifest(**datasets: dict[str, Any]) -> bytes:
    return orjson.dumps({"spec": {"datasets": [{"name": name} for name in datasets]}, "datasets": datasets})


def failures(lines: list[int], reason: str = "prompt_too_long") -> dict[str, Any]:
    content = ShardContent([], [{"line": line, "sample_index": 0, "sample_id": f"s{line}", "reason": reason}
                                for line in lines])
    return build_marker("d", "w000-t-000001", 0, content, 0)


# ---------------------------------------------------------------------------------------------------- run.json


def test_a_layouts_rows_lines_and_samples_are_bounded_before_any_ledger_is_sized():
    assert decode(manifest(d={"rows": MAX_SLOTS})).datasets["d"].rows == MAX_SLOTS
    with pytest.raises(ManifestError, match="rows\n  Input should be less than or equal to 67108864"):
        decode(manifest(d={"rows": MAX_SLOTS + 1}))
    assert decode(manifest(d={"rows": 1, "lines": MAX_SLOTS // 2, "samples": 2})).datasets["d"].slots == 2
    with pytest.raises(ManifestError, match="33554433 lines x 2 samples are over the 67108864 slots"):
        decode(manifest(d={"rows": 1, "lines": MAX_SLOTS // 2 + 1, "samples": 2}))
    assert decode(manifest(d={"rows": 1, "samples": 64})).datasets["d"].samples == 64
    with pytest.raises(ManifestError, match="samples\n  Input should be less than or equal to 64"):
        decode(manifest(d={"rows": 1, "samples": 65}))


def test_a_runs_slots_and_datasets_are_bounded_together():
    half = MAX_SLOTS // 2
    assert len(decode(manifest(a={"rows": half}, b={"rows": half})).datasets) == 2
    with pytest.raises(ManifestError, match="the layouts hold 67108865 slots together, over the 67108864"):
        decode(manifest(a={"rows": half}, b={"rows": half + 1}))
    many = {f"d{i}": {"rows": 1} for i in range(MAX_DATASETS)}
    assert len(decode(manifest(**many)).datasets) == MAX_DATASETS
    with pytest.raises(ManifestError, match="65 datasets, over the 64 a run may have"):
        decode(manifest(**many, extra={"rows": 1}))


@pytest.mark.parametrize("name", ["../x", "a/b", "", ".hidden", "ok\n", "x" * 64])
def test_a_dataset_name_read_from_run_json_is_never_a_path(name):
    assert decode(manifest(**{"ok.d-1_" + "x" * 55: {"rows": 1}})).dataset_names == ["ok.d-1_" + "x" * 55]
    with pytest.raises(ManifestError, match="is not one a spec may give"):
        decode(manifest(**{name: {"rows": 1}}))
    with pytest.raises(ManifestError, match="is not one a spec may give"):  # in the spec's list only
        decode(orjson.dumps({"spec": {"datasets": [{"name": name}]}}))


def test_json_documents_are_refused_by_their_count_of_values_before_they_are_parsed():
    at = b"[" + b"0," * 98 + b"0]"  # 99 commas and a bracket: 101 values at most
    assert json_values(at) == 100
    check_values(at, 100, "x")
    with pytest.raises(OverBound, match="x: may hold 100 JSON values, over the 99 its reader parses"):
        check_values(at, 99, "x")
    filler = b'{"datasets": {}, "x": [' + b"0," * (MANIFEST_VALUES - 5) + b"0]}"
    assert json_values(filler) == MANIFEST_VALUES and decode(filler).datasets == {}
    with pytest.raises(ManifestError, match=f"over the {MANIFEST_VALUES} its reader parses"):
        decode(filler.replace(b"[", b"[0,", 1))


def test_skipped_lines_are_read_back_as_bits_never_a_byte_per_line():
    skipped = np.zeros(20, dtype=bool)
    skipped[[2, 9, 19]] = True
    layout = DatasetLayout(rows=17, lines=20, skipped=encode_lines(skipped))
    bits = layout.within_bits()
    assert bits is not None and bits.dtype == np.uint8 and bits.size == 3
    assert np.array_equal(np.unpackbits(bits, bitorder="little", count=20).astype(bool), ~skipped)


# ------------------------------------------------------------------------------------------------ the ledger


def test_a_markers_line_is_bounded_before_the_bitmap_grows():
    at = DatasetLedger("d")
    at.fold(failures([MAX_SLOTS]))
    assert at.nbytes == MAX_SLOTS // 8 + 4096 and at.outcome(Slot(MAX_SLOTS)) == "prompt_too_long"
    with pytest.raises(OverBound, match="names line 67108865, past the 67108864 lines of 1 samples"):
        DatasetLedger("d").fold(failures([MAX_SLOTS + 1]))
    wide = build_marker("d", "w000-t-000002", 0, ShardContent(
        [], [{"line": MAX_SLOTS // 2 + 1, "sample_index": 1, "sample_id": "s", "reason": "x"}]), 0)
    with pytest.raises(OverBound, match="past the 33554432 lines of 2 samples"):
        DatasetLedger("d").fold(wide)


def test_a_runs_ledgers_share_one_byte_budget_and_a_dropped_ledger_stops_counting():
    budget = LedgerBudget(max_bytes=1024 + 4096)  # a 8192-slot bitmap and one page of failures
    first = DatasetLedger("d", 8192, 1, budget)
    first.fold(failures([1, 4096]))  # one page
    with pytest.raises(OverBound, match="d: a page of failures needs 4096 bytes more than the 5120"):
        first.fold(failures([4097]))
    with pytest.raises(OverBound, match="e: a row bitmap of 8 slots needs 1 bytes more"):
        DatasetLedger("e", 8, 1, budget)
    del first
    gc.collect()
    assert budget.held == 0 and DatasetLedger("e", 8, 1, budget).nbytes == 1


@pytest.mark.parametrize("samples", [1, 3])
def test_completeness_counted_a_chunk_at_a_time_from_the_bits_is_the_whole_answer(monkeypatch, samples):
    rng = np.random.default_rng(7)
    lines = 1000
    book = DatasetLedger("d", lines, samples)
    rows = [(int(line), int(index)) for line, index in zip(rng.integers(1, lines + 40, 900),
                                                          rng.integers(0, samples, 900), strict=True)]
    book.fold(build_marker("d", "w000-t-000001", 0, ShardContent(
        [{"sample_id": f"s{line}-{index}", "line": line, "sample_index": index, "completion_tokens": 1}
         for line, index in rows],
        [{"line": line, "sample_index": 0, "sample_id": f"f{line}", "reason": "bad_row" if line % 2 else "x"}
         for line in rng.integers(1, lines + 40, 300).tolist()]), 0))
    within = rng.random(lines - 100) < 0.9  # lines past the mask's end are kept
    whole = book.completeness(lines, samples + 1, within)
    monkeypatch.setattr(ledger, "_CHUNK_SLOTS", 64)  # ~21 chunks instead of one
    packed = np.packbits(np.concatenate([within, np.ones(-within.size % 8, dtype=bool)]), bitorder="little")
    assert book.completeness(lines, samples + 1, within) == whole == book.completeness(lines, samples + 1, packed)
    keep = np.concatenate([within, np.ones(100, dtype=bool)])
    settled = {(line, index) for line, index in rows if line <= lines and keep[line - 1]}
    assert whole.generated == len(settled) and whole.slots == int(keep.sum()) * (samples + 1)


def test_widening_a_ledger_chunk_by_chunk_keeps_every_outcome(monkeypatch):
    monkeypatch.setattr(ledger, "_CHUNK_SLOTS", 16)
    book = DatasetLedger("d", 100)
    book.fold(build_marker("d", "w000-t-000001", 0, ShardContent(
        [{"sample_id": f"s{line}", "line": line, "sample_index": 0, "completion_tokens": 1} for line in (1, 50, 99)],
        [{"line": 77, "sample_index": 0, "sample_id": "f", "reason": "bad_row", "retry_round": 2}]), 0))
    book.widen(5)
    assert [book.outcome(Slot(line)) for line in (1, 50, 99, 77, 2)] == ["row", "row", "row", "bad_row", None]
    assert book.retry_round(Slot(77)) == 2 and book.rows_beyond(1) == 0 and book.samples_per_prompt == 5


# ------------------------------------------------------------------------------------------ packed objects


ARRAYS = {"a": np.arange(100, dtype=np.int64)}


def test_a_packed_object_inflates_to_at_most_the_readers_bound():
    data = pack("x", {}, ARRAYS)
    assert np.array_equal(unpack("x", data, 800)[1]["a"], ARRAYS["a"])
    with pytest.raises(PackError, match="says it inflates to 800 bytes, over the 799 this reader inflates"):
        unpack("x", data, 799)


def test_a_payload_that_inflates_past_what_its_header_says_is_cut_at_one_byte_more():
    data = pack("x", {}, ARRAYS)
    magic, length = b"tokenmill-x\n", int.from_bytes(data[12:20], "little")
    header = orjson.loads(data[20:20 + length])
    lying = {**header, "raw_bytes": 8, "digest": ""}
    from tokenmill_runner.store.packed import _digest

    payload = data[20 + length:]
    lying["digest"] = _digest(lying, payload, b"")
    encoded = orjson.dumps(lying)
    with pytest.raises(PackError, match="does not inflate to the 8 bytes its header says"):
        unpack("x", magic + len(encoded).to_bytes(8, "little") + encoded + payload, 10**9)


def test_a_keyed_digest_refuses_an_object_written_without_the_key():
    keyed = pack("x", {}, ARRAYS, key=b"operator-secret")
    assert unpack("x", keyed, 800, key=b"operator-secret")[0]["raw_bytes"] == 800
    for key in (b"", b"another-secret"):
        with pytest.raises(PackError, match="digest does not match"):
            unpack("x", keyed, 800, key=key)
    with pytest.raises(PackError, match="or one written without this reader's key"):
        unpack("x", pack("x", {}, ARRAYS), 800, key=b"operator-secret")  # anyone can compute an unkeyed digest


def test_a_packed_header_is_bounded_before_it_is_parsed():
    big = b"tokenmill-x\n" + (HEADER_BYTES + 1).to_bytes(8, "little") + b" " * (HEADER_BYTES + 1)
    with pytest.raises(PackError, match=f"or the {HEADER_BYTES} a header may have"):
        unpack("x", big, 10)
    dense = b"[" + b"0," * 70_000 + b"0]"
    with pytest.raises(PackError, match="over the 65536 its reader parses"):
        unpack("x", b"tokenmill-x\n" + len(dense).to_bytes(8, "little") + dense, 10)


# ---------------------------------------------------------------------------------------------- checkpoints


def test_what_a_checkpoint_may_inflate_to_follows_the_readers_layout():
    assert max_raw(0) == checkpoints.RAW_SLACK
    assert max_raw(1000) == 27 * 1000 + checkpoints.RAW_SLACK
    assert max_raw(MAX_SLOTS) == max_raw(10**12) == checkpoints.RAW_BYTES


def test_the_operator_trusts_only_its_own_keyed_checkpoints_and_runners_never_read_them(tmp_path):
    storage = LocalStorage(tmp_path)
    for seq in range(1, 4):
        commit_lines(storage, "d", seq, range(seq * 10 - 9, seq * 10 + 1), T0)
    index, _ = index_store.open_index(storage, "d", 30)
    operator = Signer(key=b"operator-secret", writer=OPERATOR_WRITER)
    index_store.write_checkpoint(storage, index, OPERATOR_WRITER, T0, key=operator.key)
    assert index_store.load_index(storage, "d", 30, signer=operator).markers == 3
    assert index_store.load_index(storage, "d", 30).markers == 0, "a runner cannot verify the operator's"
    # A checkpoint written as the operator's by anyone without its key (the digest computed unkeyed): refused.
    forged = checkpoints.snapshot(index, OPERATOR_WRITER, T0)
    storage.put(f"d/index/99999999T000000.000000Z-0000000003-{OPERATOR_WRITER}-ffffffff.ckpt", forged.encode())
    runner_made = index_store.write_checkpoint(storage, index, "w000", T0)
    assert runner_made is not None and RUNNER.trusts(runner_made) and not operator.trusts(runner_made)
    assert index_store.load_index(storage, "d", 30, signer=operator).markers == 3, "the forged one is skipped"


def test_a_checkpoint_past_what_readers_inflate_is_not_written(tmp_path, monkeypatch, caplog):
    storage = LocalStorage(tmp_path)
    commit_lines(storage, "d", 1, range(1, 11), T0)
    index, _ = index_store.open_index(storage, "d", 10)
    taken = index_store.take_checkpoint(index, "w000", T0)
    monkeypatch.setattr(index_store, "RAW_BYTES", taken.raw_bytes)
    assert index_store.put_checkpoint(storage, "d", taken) is not None
    monkeypatch.setattr(index_store, "RAW_BYTES", taken.raw_bytes - 1)
    assert index_store.put_checkpoint(storage, "d", taken) is None and "no checkpoint written" in caplog.text


def test_runners_and_the_operator_each_keep_their_own_newest_checkpoints(tmp_path):
    storage = LocalStorage(tmp_path)
    commit_lines(storage, "d", 1, range(1, 11), T0)
    index = DatasetIndex(DatasetLedger("d", 10))
    index_store.catch_up(storage, index)
    index_store.write_checkpoint(storage, index, OPERATOR_WRITER, T0, key=b"k")
    for _ in range(4):
        index_store.write_checkpoint(storage, index, "w000", T0)
    names = list(storage.list("d/index/"))  # (one name of the same horizon may sort before the one just written)
    assert sum(checkpoints.writer_of(n) == OPERATOR_WRITER for n in names) == 1 and len(names) in (4, 5)


# ---------------------------------------------------------------------------------------------------- seals


def seal(storage: LocalStorage, token: str, shards_: list[str]) -> None:
    storage.put(seals.seal_key("d", token), seals.encode_seal(token, {"commits": shards_}, "x", T0))


def test_a_seal_is_read_within_its_byte_cap_and_names_only_its_tokens_shards(tmp_path, monkeypatch):
    storage = LocalStorage(tmp_path)
    seal(storage, "aaaa", ["w000-aaaa-000001"])
    size = (tmp_path / "d" / "seals" / "aaaa.json").stat().st_size
    monkeypatch.setattr(seals, "SEAL_BYTES", size)
    assert seals.read_seals(storage, "d").counts("commits", "w000-aaaa-000001")
    monkeypatch.setattr(seals, "_cache", seals._SealCache())
    monkeypatch.setattr(seals, "SEAL_BYTES", size - 1)
    with pytest.raises(seals.SealError, match=f"is over the {size - 1} bytes such an object may have"):
        seals.read_seals(storage, "d")
    seal(storage, "bbbb", ["w000-aaaa-000002"])
    monkeypatch.setattr(seals, "SEAL_BYTES", 4096)
    with pytest.raises(seals.SealError, match="names is not a map of folders to lists of names of run token bbbb"):
        seals.read_seals(storage, "d")


def test_a_datasets_seals_are_bounded_in_number_and_bytes_before_any_is_read(tmp_path, monkeypatch):
    storage = LocalStorage(tmp_path)
    for token in ("aaaa", "bbbb"):
        seal(storage, token, [f"w000-{token}-000001"])
    total = sum(path.stat().st_size for path in (tmp_path / "d" / "seals").iterdir())
    monkeypatch.setattr(seals, "MAX_SEALS", 2)
    monkeypatch.setattr(seals, "SEALS_BYTES", total)
    assert set(seals.read_seals(storage, "d").sealed) == {"aaaa", "bbbb"}
    monkeypatch.setattr(seals, "SEALS_BYTES", total - 1)
    with pytest.raises(seals.SealError, match=f"holds 2 seals of {total} bytes, past the 2 seals and {total - 1}"):
        seals.read_seals(storage, "d")
    monkeypatch.setattr(seals, "SEALS_BYTES", total)
    monkeypatch.setattr(seals, "MAX_SEALS", 1)
    with pytest.raises(seals.SealError, match="past the 1 seals"):
        seals.read_seals(storage, "d")


def test_parsed_seals_are_cached_within_a_byte_budget_least_recently_used_first():
    cache = seals._SealCache(max_bytes=16)  # two seals of one shard id (8 bytes each)
    one = {"commits": np.array([1], dtype=np.uint64)}
    cache.put("a", ("a", one))
    cache.put("b", ("b", one))
    assert cache.get("a") is not None and cache.held == 16  # a is now the most recently used
    cache.put("c", ("c", one))
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None and cache.held == 16
    cache.put("huge", ("h", {"commits": np.zeros(3, dtype=np.uint64)}))  # larger than the whole budget: never kept
    assert cache.get("huge") is None and cache.held == 16


# -------------------------------------------------------------------------------------------------- markers


def test_a_marker_is_bounded_by_its_values_before_it_is_parsed(monkeypatch):
    body = b'{"samples": {}, "failed": {}, "x": [0,0,0]}'
    assert json_values(body) == 9
    monkeypatch.setattr(markers, "MARKER_VALUES", 9)
    assert markers.decode_marker(body, "m")["x"] == [0, 0, 0]
    monkeypatch.setattr(markers, "MARKER_VALUES", 8)
    with pytest.raises(OverBound, match="m: may hold 9 JSON values, over the 8"):
        markers.decode_marker(body, "m")
    with pytest.raises(ledger.MarkerError, match="m is not a commit marker"):
        markers.decode_marker(b"[1]", "m")


def test_markers_are_read_ahead_within_a_byte_window(tmp_path, monkeypatch):
    storage = LocalStorage(tmp_path)
    for seq in range(10):
        storage.put(f"m{seq}", b"x" * 100)
    monkeypatch.setattr(markers, "WINDOW_BYTES", 300)
    pulled, ahead = [0], []

    def entries():
        for seq in range(10):
            pulled[0] += 1
            yield f"m{seq}", 100

    for done, (key, data) in enumerate(markers.iter_keyed(storage, entries()), start=1):
        ahead.append(pulled[0] - done)
        assert data == b"x" * 100 and key == f"m{done - 1}"
    assert max(ahead) == 3, ahead  # the window holds 300 bytes of markers, never more


# -------------------------------------------------------------------------------------------------- Parquet


def test_only_the_columns_a_reader_names_are_decoded(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"sample_id": ["a", "b"], "unused": ["x" * 1000, "y"], "n": [1, 2]}), path)
    rows = parquet_rows.open_parquet(str(path), ("sample_id", "messages"))
    assert rows.columns == ["sample_id"] and list(parquet_rows.bounded_rows(rows, None)) == [
        {"sample_id": "a"}, {"sample_id": "b"}]
    assert rows.group_bytes(0)[0] < parquet_rows.open_parquet(str(path)).group_bytes(0)[0]


def test_the_columns_read_are_bounded_together_per_row_group(tmp_path, monkeypatch):
    path = tmp_path / "p.parquet"
    text = "a" * 300_000  # each chunk ~300 KB from a few hundred bytes: over 100x
    pq.write_table(pa.table({"prompt": [text], "system": [text], "unused": [text]}), path, compression="zstd",
                   use_dictionary=False)
    two = parquet_rows.open_parquet(str(path), ("prompt", "system"))
    size, stored = two.group_bytes(0)
    monkeypatch.setattr(parquet_rows, "MAX_CHUNK_BYTES", size)
    assert parquet_rows.bomb(two, 0) is None
    monkeypatch.setattr(parquet_rows, "MAX_CHUNK_BYTES", size - 1)
    why = parquet_rows.bomb(two, 0)
    assert why is not None and why.startswith(f"row group 0: the columns read (prompt, system) are {size} bytes")
    assert parquet_rows.bomb(parquet_rows.open_parquet(str(path), ("prompt",)), 0) is None, "each alone is under"


# ------------------------------------------------------------------------------------------------- shards


def one_shard(tmp_path) -> tuple[LocalStorage, str]:
    storage = LocalStorage(tmp_path)
    rows = [{"sample_id": "s1", "dataset": "d", "line": 1, "sample_index": 0, "prompt_ids": [1] * 100,
             "output_ids": [2]}]
    marker = shards.commit_shard(storage, "d", "w000-aaaa-000001", 0, ShardContent(rows, []))
    return storage, f"d/{marker['data']}"


def test_a_shards_rows_and_bytes_are_bounded(tmp_path, monkeypatch):
    storage, key = one_shard(tmp_path)
    opened = parquet_rows.open_parquet(str(tmp_path / key), shards.ROW_SCHEMA.names)
    [size] = parquet_rows.row_sizes(next(opened.file.iter_batches(columns=opened.columns))).tolist()
    monkeypatch.setattr(shards, "SHARD_ROW_BYTES", size)
    assert [r["sample_id"] for r in shards.read_shard(storage, key)] == ["s1"]
    monkeypatch.setattr(shards, "SHARD_ROW_BYTES", size - 1)
    with pytest.raises(OverBound, match=f"row 0: {size} bytes, over the {size - 1} a committed row may have"):
        list(shards.read_shard(storage, key))
    stored = (tmp_path / key).stat().st_size
    monkeypatch.setattr(shards, "SHARD_BYTES", stored - 1)
    with pytest.raises(ObjectTooLarge, match=f"is over the {stored - 1} bytes"):
        list(shards.read_shard(storage, key))


def test_a_file_without_a_shards_columns_is_refused_before_a_row_is_read(tmp_path):
    storage, key = one_shard(tmp_path)
    pq.write_table(pa.table({"sample_id": ["s1"], "line": ["one"], "prompt_ids": [[1]], "output_ids": [[2]]}),
                   tmp_path / key)
    with pytest.raises(StorageError, match="not a shard tokenmill wrote: its column line is string, not int64"):
        list(shards.read_shard(storage, key))


# ---------------------------------------------------------------------------------------- the local store


def test_local_keys_stay_inside_the_root_and_reads_take_regular_files_only(tmp_path):
    root = tmp_path / "out"
    storage = LocalStorage(root)
    storage.put("report/ok.png", b"png")
    for key in ("../escape.png", "report/../../escape.png", "/etc/hostname"):
        with pytest.raises(StorageError, match="is not a key inside"):
            storage.put(key, b"x")
    assert not (tmp_path / "escape.png").exists()
    (tmp_path / "secret").write_bytes(b"not the output's")
    (root / "link").symlink_to(tmp_path / "secret")
    with pytest.raises(StorageError, match="a symlink out of it"):
        storage.get("link")
    os.mkfifo(root / "fifo")
    with pytest.raises(StorageError, match="is not a regular file"):
        storage.open_read("fifo")


def test_a_bounded_read_refuses_a_file_by_its_size_without_reading_it(tmp_path):
    storage = LocalStorage(tmp_path)
    with open(tmp_path / "sparse", "wb") as handle:
        handle.truncate(8 << 30)
    with pytest.raises(ObjectTooLarge, match="is over the 1024 bytes"):
        get_bounded(storage, "sparse", 1024)
    storage.put("small", b"x" * 1024)
    assert get_bounded(storage, "small", 1024) == b"x" * 1024


# -------------------------------------------------------------------------------------- scans, hidden states


def test_a_cached_scan_inflates_to_at_most_its_bound(monkeypatch):
    from tokenmill_runner.source import scan_cache
    from tokenmill_runner.source.duplicates import DuplicateIds
    from tokenmill_runner.source.scan import SourceScan

    scan = SourceScan(3, 3, DuplicateIds(np.zeros(2, np.uint64), np.zeros(2, np.int64)), None, 3, None, None)
    data = scan_cache.encode_scan(scan, {})
    monkeypatch.setattr(scan_cache, "SCAN_RAW_BYTES", 32)
    assert decode_scan(data).rows == 3
    monkeypatch.setattr(scan_cache, "SCAN_RAW_BYTES", 31)
    with pytest.raises(PackError, match="over the 31 this reader inflates"):
        decode_scan(data)


def test_the_hidden_state_report_holds_a_bounded_number_of_samples(tmp_path, monkeypatch):
    from tokenmill_runner.store import hidden_states

    storage = LocalStorage(tmp_path)
    commit_lines(storage, "d", 1, range(1, 6), T0)
    monkeypatch.setattr(hidden_states, "MAX_STATE_SAMPLES", 5)
    keys, lengths = expected_lengths(storage, "d")
    assert keys.size == 5 and keys.dtype == np.uint64 and lengths.dtype == np.int64
    monkeypatch.setattr(hidden_states, "MAX_STATE_SAMPLES", 4)
    with pytest.raises(OverBound, match="the commit markers name over 4 samples"):
        expected_lengths(storage, "d")
