from tokenmill_runner.store.ledger import MARKER_VERSION, ShardContent, Slot
from tokenmill_runner.store.markers import read_markers
from tokenmill_runner.store.shards import (
    ShardBuffer,
    commit_shard,
    decode_rows,
    leftovers,
    new_run_token,
    read_committed_rows,
    read_ledger,
)
from tokenmill_runner.store.storage import LocalStorage


def row(i: int, dataset: str = "d") -> dict:
    return {"sample_id": f"s{i}", "dataset": dataset, "line": i + 1, "sample_index": 0, "prompt_ids": [1, 2, 3],
            "output_ids": [5] * i + [9], "prompt_tokens": 3, "completion_tokens": i + 1,
            "finish_reason": "stop", "matched_stop": 9, "reasoning_end": None if i % 2 else 0,
            "reasoning_end_token_id": None if i % 2 else 5,
            "has_tool_call": bool(i % 3 == 0), "cached_tokens": i, "server_reasoning_tokens": None if i % 2 else 1,
            "reasoning_agrees": None if i % 2 else True, "max_new_tokens": 100, "latency_s": 0.5, "attempts": 1,
            "seed": 1000 + i}


def error(line: int) -> dict:
    return {"dataset": "d", "line": line, "sample_index": 0, "sample_id": None, "reason": "invalid_json",
            "message": f"line {line}"}


def test_buffer_rolls_by_count():
    buffer = ShardBuffer(max_samples=3, max_seconds=60)
    for i in range(2):
        buffer.add_row(row(i), now=0.0)
    assert not buffer.is_due(1.0)
    buffer.add_row(row(2), now=1.0)
    assert buffer.is_due(1.0)
    content = buffer.take()
    assert len(content.rows) == 3 and len(buffer) == 0 and not buffer.is_due(100.0)


def test_buffer_rolls_by_age_from_its_first_item():
    buffer = ShardBuffer(max_samples=100, max_seconds=10)
    assert not buffer.is_due(1000.0)  # empty buffers never commit
    buffer.add_error(error(1), now=5.0)
    buffer.add_row(row(1), now=14.0)
    assert not buffer.is_due(14.9)
    assert buffer.is_due(15.0)


def test_rows_and_markers_round_trip(tmp_path):
    storage = LocalStorage(tmp_path)
    content = ShardContent([row(i) for i in range(4)], [error(10)])
    marker = commit_shard(storage, "d", "w000-abc-000001", 0, content)
    rows = decode_rows(storage.get("d/shards/w000-abc-000001.parquet"))
    assert rows == content.rows
    [read] = read_markers(storage, "d")
    assert read == marker and read["version"] == MARKER_VERSION == 2
    assert read["samples"]["sample_id"] == ["s0", "s1", "s2", "s3"]
    assert read["samples"]["line"] == [1, 2, 3, 4] and read["samples"]["sample_index"] == [0, 0, 0, 0]
    assert read["samples"]["completion_tokens"] == [1, 2, 3, 4]
    assert read["samples"]["reasoning_end"] == [0, None, 0, None]
    assert read["samples"]["cached_tokens"] == [0, 1, 2, 3]
    assert read["failed"] == {"line": [10], "sample_index": [0], "sample_id": [None], "reason": ["invalid_json"]}
    ledger = read_ledger(storage, "d", rows=10)
    assert ledger.is_done(Slot(3)) and ledger.is_done(Slot(10)) and not ledger.is_done(Slot(5))
    assert ledger.completed == 4 and ledger.final_failures() == {"invalid_json": 1}
    assert list(read_committed_rows(storage, "d")) == content.rows


def test_uncommitted_files_are_leftovers_of_their_worker_only(tmp_path):
    storage = LocalStorage(tmp_path)
    commit_shard(storage, "d", "w000-aaa-000001", 0, ShardContent([row(1)], []))
    storage.put("d/shards/w000-bbb-000002.parquet", b"partial")  # killed before its marker
    storage.put("d/shards/w001-ccc-000001.parquet", b"other worker")
    (tmp_path / "d/commits/w000-bbb-000003.json.tmp-x1").write_bytes(b"{")
    assert sorted(leftovers(storage, "d", worker=0)) == ["d/commits/w000-bbb-000003.json.tmp-x1",
                                                        "d/shards/w000-bbb-000002.parquet"]
    assert "d/shards/w001-ccc-000001.parquet" in set(leftovers(storage, "d"))
    assert [m["shard_id"] for m in read_markers(storage, "d")] == ["w000-aaa-000001"]


def test_a_retried_line_counts_once_by_its_last_outcome(tmp_path):
    storage = LocalStorage(tmp_path)
    outage = [{"dataset": "d", "line": n, "sample_index": 0, "sample_id": f"s{n - 1}", "reason": "retries_exhausted",
               "message": "server down"} for n in (2, 3)]
    bad = {"dataset": "d", "line": 9, "sample_index": 0, "sample_id": None, "reason": "invalid_json",
           "message": "line 9"}
    commit_shard(storage, "d", "w000-a-000001", 0, ShardContent([row(0)], [*outage, bad]))
    first = read_ledger(storage, "d")
    assert dict(first.failed_slots()) == {Slot(2): "retries_exhausted", Slot(3): "retries_exhausted",
                                         Slot(9): "invalid_json"}
    assert first.is_done(Slot(2)) and first.is_done(Slot(9))  # a plain resume skips recorded failures
    assert not first.is_done(Slot(2), retry_failed=True) and first.is_done(Slot(9), retry_failed=True)
    commit_shard(storage, "d", "w000-b-000001", 0, ShardContent([row(1)], [outage[1]]))  # line 2 ok, 3 failed again
    after = read_ledger(storage, "d")
    assert dict(after.failed_slots()) == {Slot(3): "retries_exhausted", Slot(9): "invalid_json"}
    assert after.failed == 2 and after.completed == 2 and after.given_up() == {"retries_exhausted": 1}


def test_run_tokens_are_64_bit_and_distinct():
    tokens = {new_run_token() for _ in range(1000)}
    assert len(tokens) == 1000 and {len(t) for t in tokens} == {16}
    assert all(int(t, 16) >= 0 for t in tokens)


def test_a_shard_written_before_the_server_accounting_columns_still_reads(tmp_path):
    """Shards of earlier runs have no cached_tokens / server_reasoning_tokens / reasoning_agrees: they read back
    without them, and the report and inspect treat them as not recorded."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from tokenmill_runner.store.shards import ROW_SCHEMA

    new = ("cached_tokens", "server_reasoning_tokens", "reasoning_agrees")
    old_schema = pa.schema([field for field in ROW_SCHEMA if field.name not in new])
    old = [{k: v for k, v in row(i).items() if k not in new} for i in range(2)]
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(old, schema=old_schema), sink)
    rows = decode_rows(sink.getvalue())
    assert [r["sample_id"] for r in rows] == ["s0", "s1"]
    assert all(name not in r for r in rows for name in new)
