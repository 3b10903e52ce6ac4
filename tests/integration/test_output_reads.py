"""An output prefix written by someone else, read as every reader reads it: the shared operator (through the runner's
store modules, as `gather.observe_progress` does), `tokenmill run` reading its source, `report`, `inspect` and
`export`. Each case is a reproduction of security-f9665d2.md (B5-B10): a few bytes to a few MB that said or
decoded to gigabytes. Memory is measured in a child (peak_rss.py, killed past KILL_KB); each fails on f9665d2
(docs/security.md "What a reader takes from an output")."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill_runner.store.ledger import ShardContent
from tokenmill_runner.store.shards import commit_shard
from tokenmill_runner.store.storage import LocalStorage

from .workloads import chat

CLI = [sys.executable, "-m", "tokenmill_runner.cli"]
ROOT = Path(__file__).resolve().parents[2]
# A child that imports numpy, pyarrow and pydantic starts near 100 MB (the CLI with its libraries near 200 MB); the
# unbounded readers of f9665d2 passed 500 MB on every case below, most of them gigabytes.
KILL_KB = 450 * 1024
# What the operator's pass reads of a tenant's output: its own observe_progress (run.json, then per dataset its
# checkpoint, the markers it lacks and the layout's completeness, through the runner's store modules).
OBSERVE = """
import sys
from datetime import UTC, datetime
from tokenmill_runner.store.storage import LocalStorage
try:
    from tokenmill_operator.observe.gather import OutputIndex, observe_progress
except ImportError:  # before the operator's layers (f9665d2)
    from tokenmill_operator.gather import OutputIndex, observe_progress
facts, _ = observe_progress(LocalStorage(sys.argv[1]), OutputIndex(), datetime.now(UTC), None)
print(facts.overall.model_dump() if facts else None)
"""
# What `tokenmill run` resuming reads of its output (prepare.py): per dataset its checkpoint and every marker.
RESUME = """
import sys
from tokenmill_runner.store.index_store import open_index
from tokenmill_runner.store.storage import LocalStorage
index, _ = open_index(LocalStorage(sys.argv[1]), "d", 100)
print("markers", index.markers)
"""


def peak(command: list[str], tmp_path: Path) -> tuple[int, int, bool, str]:
    """(exit code, peak RSS in kB, killed, stderr) of a command, through peak_rss.py."""
    stderr = tmp_path / "stderr.txt"
    measured = subprocess.run([sys.executable, str(Path(__file__).with_name("peak_rss.py")), str(KILL_KB), *command],
                              capture_output=True, text=True, timeout=300, check=True, cwd=ROOT,
                              env={**os.environ, "PEAK_RSS_STDERR": str(stderr)})
    result = json.loads(measured.stdout)
    return result["code"], result["peak_kb"], result["killed"], stderr.read_text()


def observe(out: Path, tmp_path: Path) -> tuple[int, int, bool, str]:
    return peak([sys.executable, "-c", OBSERVE, str(out)], tmp_path)


def assert_refused(result: tuple[int, int, bool, str], message: str) -> None:
    code, peak_kb, killed, stderr = result
    print(f"exit {code}, peak {peak_kb} kB: {stderr.strip().splitlines()[-1:] if stderr.strip() else ''}")
    assert not killed and peak_kb < KILL_KB, f"peak RSS {peak_kb} kB"
    assert code != 0 and message in stderr, stderr[-2000:]


def zeros_payload(size: int) -> bytes:
    """zlib of `size` zero bytes, compressed 16 MiB at a time (pytest never holds them): ~4.5 KB a MiB."""
    deflate, chunk = zlib.compressobj(1), bytes(16 << 20)
    parts = [deflate.compress(chunk) for _ in range(size // len(chunk))]
    return b"".join([*parts, deflate.flush()])


def packed(kind: str, header: dict, payload: bytes) -> bytes:
    """A packed object (store/packed.py's layout) with a valid unkeyed digest, as anyone who can write the prefix
    can make one (written out here so the test builds the same file against any version)."""
    full = {**header, "digest": ""}
    full["digest"] = hashlib.blake2b(orjson.dumps(full) + payload, digest_size=32).hexdigest()
    encoded = orjson.dumps(full)
    return f"tokenmill-{kind}\n".encode() + len(encoded).to_bytes(8, "little") + encoded + payload


# ------------------------------------------------------------------------------------------------ B5: counts


def test_a_105_byte_run_json_cannot_size_a_readers_ledger(tmp_path):
    """f9665d2: rows 500000000 took the operator's pass to 5.9 GB (a bit, then bytes, per slot)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.json").write_bytes(b'{"datasets": {"d": {"rows": 500000000}}}')
    assert_refused(observe(out, tmp_path), "Input should be less than or equal to 67108864")


def test_a_marker_naming_a_far_line_cannot_size_a_readers_ledger(tmp_path):
    """f9665d2: one 140-byte marker naming line 3*10^8 of a 10-row run took the reader to 659 MB."""
    out = tmp_path / "out"
    storage = LocalStorage(out)
    storage.put("run.json", b'{"datasets": {"d": {"rows": 10}}}')
    marker = {"shard_id": "w000-t-000001", "samples": {"line": [300_000_000], "sample_index": [0]}, "failed": {}}
    storage.put("d/commits/w000-t-000001.json", orjson.dumps(marker))
    assert_refused(observe(out, tmp_path), "names line 300000000, past the 67108864 lines")


def test_a_16_mib_run_json_of_empty_objects_is_refused_before_it_is_parsed(tmp_path):
    """f9665d2: 16 MiB of `{},` (the byte cap) parsed into 5.6 million dicts, 604 MB."""
    out = tmp_path / "out"
    out.mkdir()
    body = b'{"datasets": {}, "x": [' + b"{}," * (16 * 1024 * 1024 // 3 - 20) + b"{}]}"
    (out / "run.json").write_bytes(body)
    assert_refused(observe(out, tmp_path), "over the 100000 its reader parses")


# ------------------------------------------------------------------------------------------ B6: inflation


def test_a_forged_checkpoint_is_refused_by_the_operator_and_not_inflated_by_a_runner(tmp_path):
    """f9665d2: a 1 MiB checkpoint of zeros (its digest anyone can compute) inflated whole, 2.1 GB in the operator
    and 2.2 GB in a resuming `tokenmill run`; here 256 MiB. The operator keys its own checkpoints' digests, so it
    refuses the forged one unread; a runner inflates it no further than its layout can hold."""
    out = tmp_path / "out"
    storage = LocalStorage(out)
    storage.put("run.json", b'{"datasets": {"d": {"rows": 100}}}')
    payload = zeros_payload(256 << 20)
    header = {"version": 1, "dataset": "d", "arrays": [{"name": "rows", "dtype": "|u1", "count": 256 << 20}],
              "raw_bytes": 256 << 20}
    for writer in ("operator", "w000"):
        storage.put(f"d/index/zzzz-9999999999-{writer}-ffffffff.ckpt", packed("checkpoint", header, payload))
    for script, message in ((OBSERVE, "digest does not match its content (a torn or altered object, or one written "
                                      "without this reader's key)"),
                            (RESUME, "says it inflates to 268435456 bytes, over the 1051276 this reader inflates")):
        code, peak_kb, killed, stderr = peak([sys.executable, "-c", script, str(out)], tmp_path)
        print(f"forged checkpoint of {len(payload)} bytes: exit {code}, peak {peak_kb} kB")
        assert not killed and peak_kb < KILL_KB and code == 0, (peak_kb, stderr[-2000:])
        assert message in stderr, stderr[-2000:]


def test_a_forged_source_scan_is_not_inflated_past_its_bound(tmp_path):
    """f9665d2: the scan cache was read whole and inflated whole, as checkpoints were (2.2 GB in `tokenmill run`)."""
    forged = tmp_path / "forged.scan"
    forged.write_bytes(packed("scan", {"version": 4, "rows": 1, "worker_rows": 1, "raw_bytes": 512 << 20,
                                       "arrays": [{"name": "owned", "dtype": "|u1", "count": 512 << 20}]},
                              zeros_payload(512 << 20)))
    script = ("import sys; from pathlib import Path; from tokenmill_runner.source.scan_cache import decode_scan; "
              "decode_scan(Path(sys.argv[1]).read_bytes())")
    assert_refused(peak([sys.executable, "-c", script, str(forged)], tmp_path),
                   "says it inflates to 536870912 bytes, over the 134217728 this reader inflates")


# ----------------------------------------------------------------------------------------------- B7: seals


def test_a_64_mib_seal_is_refused_unread(tmp_path):
    """f9665d2: a 62 MB seal of 9 million shard ids was parsed into a frozenset (1,148 MB) and kept for ever."""
    out = tmp_path / "out"
    storage = LocalStorage(out)
    storage.put("run.json", b'{"datasets": {"d": {"rows": 10}}}')
    (out / "d" / "seals").mkdir(parents=True)
    with (out / "d" / "seals" / "aaaa.json").open("wb") as seal:
        seal.write(b'{"token": "aaaa", "by": "x", "at": "2026-01-01T00:00:00+00:00", "shards": [')
        ids = b",".join(b'"w000-aaaa-%06d"' % i for i in range(10_000))
        for _ in range(300):  # 300 x 10,000 ids, ~60 MB
            seal.write(ids + b",")
        seal.write(b'"w000-aaaa-999999"]}')
    storage.put("d/commits/w000-aaaa-000001.json", orjson.dumps({"samples": {}, "failed": {}}))
    assert_refused(observe(out, tmp_path), "is over the 16777216 bytes such an object may have")


# ------------------------------------------------------------------------------------- B8: unused columns


def write_wide(path: Path, columns: int, megabytes: int) -> None:
    """A good row, a row with `columns` extra plain-encoded zstd columns of `megabytes` each (one buffer shared by
    them all), another good row: each chunk under parquet_rows.MAX_CHUNK_BYTES, every one unused by the layout."""
    big = pa.array([None, "a" * (megabytes << 20), None], pa.string())
    messages = pa.array([chat(1)["messages"], chat(2)["messages"], chat(3)["messages"]])
    table = pa.table({"sample_id": ["s1", "s2", "s3"], "messages": messages,
                      **{f"x{i}": big for i in range(columns)}})
    pq.write_table(table, path, compression="zstd", compression_level=3, use_dictionary=False)


def test_unused_parquet_columns_are_never_decoded(tmp_path):
    """f9665d2: a 69 KB file of eight unused 250 MiB columns took `tokenmill run` to 6.4 GB (every column decoded
    before any row was sized); here eight of 64 MiB, read as `tokenmill run` reads its source."""
    source = tmp_path / "wide.parquet"
    subprocess.run([sys.executable, "-c", f"from {__name__} import write_wide; from pathlib import Path; "
                    f"write_wide(Path({str(source)!r}), 8, 64)"], check=True, timeout=300, cwd=ROOT)
    script = ("import sys; from tokenmill_runner.source.reader import read_prompts; "
              "from tokenmill_runner.source.row_size import RowBound; "
              "rows = list(read_prompts(sys.argv[1], 'parquet', bound=RowBound(524288))); "
              "sys.stderr.write(repr([getattr(r, 'sample_id', None) for r in rows])); sys.exit(3)")
    code, peak_kb, killed, stderr = peak([sys.executable, "-c", script, str(source)], tmp_path)
    print(f"{source.stat().st_size} bytes, 8 unused columns of 64 MiB: peak {peak_kb} kB")
    assert not killed and peak_kb < 250 * 1024, peak_kb
    assert code == 3 and stderr == "['s1', 's2', 's3']", stderr[-2000:]


# ----------------------------------------------------------------------------- B9: inspect and export


def committed_output(out: Path) -> Path:
    """A run's output as tokenmill writes it: run.json and one committed shard of eight rows of dataset d."""
    storage = LocalStorage(out)
    storage.put("run.json", orjson.dumps({"spec": {"datasets": [{"name": "d"}]}, "datasets": {"d": {"rows": 8}},
                                          "tokenizer": {"location": str(ROOT / "examples" / "demo-model")}}))
    rows = [{"sample_id": f"s{i}", "dataset": "d", "line": i + 1, "sample_index": 0, "prompt_ids": [1, 2],
             "output_ids": [3], "prompt_tokens": 2, "completion_tokens": 1, "finish_reason": "stop"} for i in range(8)]
    marker = commit_shard(storage, "d", "w000-aaaa-000001", 0, ShardContent(rows, []))
    return out / "d" / marker["data"]


def test_inspect_and_export_read_a_5_kb_shard_bomb_bounded(tmp_path):
    """f9665d2: 8 rows of one dictionary-encoded 50 MB string (5.5 KB) took inspect and export to 1.43 GB."""
    shard = committed_output(tmp_path / "out")
    big = pa.DictionaryArray.from_arrays(pa.array([0] * 8, pa.int32()), pa.array(["b" * (50 << 20)]))
    pq.write_table(pa.table({"bomb": big}), shard, compression="zstd", use_dictionary=True)
    print(f"shard bomb: {shard.stat().st_size} bytes")
    message = "is not a shard tokenmill wrote: its column sample_id is missing"
    assert_refused(peak([*CLI, "inspect", str(tmp_path / "out"), "--random", "1"], tmp_path), message)
    assert_refused(peak([*CLI, "export", str(tmp_path / "out"), str(tmp_path / "hf"), "--format", "hf"], tmp_path),
                   message)


def test_export_refuses_a_sparse_8_gib_shard_and_inspect_a_run_json_that_is_a_device(tmp_path):
    """f9665d2: export read a sparse 8 GiB shard whole (8.5 GB); inspect read run.json -> /dev/zero (MemoryError)."""
    shard = committed_output(tmp_path / "out")
    with shard.open("r+b") as handle:
        handle.truncate(8 << 30)
    assert_refused(peak([*CLI, "export", str(tmp_path / "out"), str(tmp_path / "hf"), "--format", "hf"], tmp_path),
                   "is over the 4294967296 bytes such an object may have")
    run_json = tmp_path / "out" / "run.json"
    run_json.unlink()
    run_json.symlink_to("/dev/zero")
    assert_refused(peak([*CLI, "inspect", str(tmp_path / "out"), "--random", "1"], tmp_path),
                   "is not a key inside")


# -------------------------------------------------------------------------- B10: names never become paths


def test_report_writes_only_inside_the_outputs_report_folder(tmp_path):
    """f9665d2: a dataset name `../../../escape/pwned` in run.json made `report` write <scratch>/escape/pwned.png."""
    out = tmp_path / "rep" / "out"
    out.mkdir(parents=True)
    name = "../../../escape/pwned"
    (out / "run.json").write_text(json.dumps({"spec": {"datasets": [{"name": name}]},
                                              "datasets": {name: {"rows": 1}}}))
    report = subprocess.run([*CLI, "report", str(out)], capture_output=True, text=True, timeout=120)
    assert report.returncode == 1 and "dataset name '../../../escape/pwned' is not one a spec may give" in \
        report.stderr, report.stderr[-2000:]
    assert not (tmp_path / "escape").exists() and not (tmp_path / "rep" / "escape").exists()


def test_a_marker_naming_a_file_outside_the_output_is_refused(tmp_path):
    """security-f9665d2.md W5: a marker's `data: ../../../../../../etc/hostname` made inspect read that file."""
    committed_output(tmp_path / "out")
    [marker_file] = (tmp_path / "out" / "d" / "commits").iterdir()
    marker = orjson.loads(marker_file.read_bytes())
    marker["data"] = "../" * 12 + "etc/hostname"
    marker_file.write_bytes(orjson.dumps(marker))
    inspect = subprocess.run([*CLI, "inspect", str(tmp_path / "out"), "--random", "1"], capture_output=True,
                             text=True, timeout=120)
    assert inspect.returncode == 1 and "is not a key inside" in inspect.stderr, inspect.stderr[-2000:]
