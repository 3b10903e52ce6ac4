"""Export files at the edge: records streamed into local spool files, each put into the destination whole.

A file is written to a spool folder, closed, hashed and then put into the destination storage atomically (a local
rename, or an S3 upload that appears on completion), so a reader never sees half a file. Files that hold many
records roll over into numbered parts at `part_bytes`. The manifest, written by the exporter after every file, is
what makes an export complete.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from ..store.storage import Storage
from .formats import HF_COLUMNS, ExportFormat, features, hf_schema_metadata, schema_metadata
from .manifest import WrittenFile

logger = logging.getLogger(__name__)

HASH_CHUNK = 8 * 1024 * 1024
ROW_GROUP_RECORDS = 1024
ARROW_TYPES: dict[str, Callable[[], pa.DataType]] = {
    "string": pa.string, "int8": pa.int8, "int32": pa.int32, "int64": pa.int64, "bool": pa.bool_,
}


def arrow_type(name: str) -> pa.DataType:
    # pa.list_, not pa.large_list: datasets loads a large list as LargeList, not the List trainers expect.
    if name.startswith("list<"):
        return pa.list_(arrow_type(name[len("list<"):-1]))
    return ARROW_TYPES[name]()


def hf_schema() -> pa.Schema:
    schema = pa.schema([(name, arrow_type(kind)) for name, kind in HF_COLUMNS])
    return schema.with_metadata({b"huggingface": hf_schema_metadata()})


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def publish(destination: Storage, key: str, path: Path, records: int, tokens: int = 0) -> WrittenFile:
    size = path.stat().st_size
    digest = sha256_of(path)
    destination.put_file(key, path)
    logger.info("wrote %s (%d records, %d tokens, %d bytes)", destination.uri(key), records, tokens, size)
    return WrittenFile(key, records, size, digest, tokens)


class JsonlFiles:
    """JSON lines into one file, or into numbered parts when the format has a part prefix."""

    def __init__(self, destination: Storage, spool: Path, fmt: ExportFormat | None, part_bytes: int,
                 single_name: str | None = None) -> None:
        self.destination, self.spool, self.fmt, self.part_bytes = destination, spool, fmt, part_bytes
        self.single_name = single_name or (fmt.single_file if fmt else None)
        self.files: list[WrittenFile] = []
        self._handle: BinaryIO | None = None
        self._key = ""
        self._records = 0
        self._bytes = 0
        self._tokens = 0

    def _open(self) -> BinaryIO:
        if self._handle is None:
            self._key = self.single_name or self.fmt.part_name(len(self.files))  # type: ignore[union-attr]
            path = self.spool / self._key.replace("/", "__")
            self._handle = path.open("wb")
            self._records = self._bytes = self._tokens = 0
        return self._handle

    def write(self, record: dict[str, Any]) -> None:
        line = orjson.dumps(record) + b"\n"
        self._open().write(line)
        self._records += 1
        self._bytes += len(line)
        self._tokens += len(record.get("input_ids") or ())
        if self.single_name is None and self._bytes >= self.part_bytes:
            self._finish()

    def _finish(self) -> None:
        if self._handle is None:
            return
        handle, self._handle = self._handle, None
        handle.flush()
        os.fsync(handle.fileno())
        handle.close()
        self.files.append(publish(self.destination, self._key, Path(handle.name), self._records, self._tokens))

    def close(self) -> list[WrittenFile]:
        self._finish()
        return self.files


class ParquetFiles:
    """Parquet parts with the hf schema (features declared), ROW_GROUP_RECORDS records per row group."""

    def __init__(self, destination: Storage, spool: Path, fmt: ExportFormat, part_bytes: int) -> None:
        self.destination, self.spool, self.fmt, self.part_bytes = destination, spool, fmt, part_bytes
        self.schema = hf_schema()
        self.files: list[WrittenFile] = []
        self._pending: list[dict[str, Any]] = []
        self._writer: pq.ParquetWriter | None = None
        self._path: Path | None = None
        self._key = ""
        self._records = 0
        self._bytes = 0
        self._tokens = 0

    def write(self, record: dict[str, Any]) -> None:
        self._pending.append(record)
        self._tokens += len(record["input_ids"])
        if len(self._pending) >= ROW_GROUP_RECORDS:
            self.flush()

    def flush(self) -> None:
        """Write what is pending as one row group."""
        if not self._pending:
            return
        table = pa.Table.from_pylist(self._pending, schema=self.schema)
        self._pending = []
        if self._writer is None:
            self._key = self.fmt.part_name(len(self.files))
            self._path = self.spool / self._key.replace("/", "__")
            self._writer = pq.ParquetWriter(self._path, self.schema, compression="zstd")
            self._records = self._bytes = 0
        self._writer.write_table(table)
        self._records += table.num_rows
        self._bytes += table.nbytes  # uncompressed: parts come out smaller than part_bytes on disk
        if self._bytes >= self.part_bytes:
            self._finish()

    def _finish(self) -> None:
        if self._writer is None or self._path is None:
            return
        self._writer.close()
        self._writer = None
        self.files.append(publish(self.destination, self._key, self._path, self._records, self._tokens))
        self._tokens = 0

    def close(self) -> list[WrittenFile]:
        self.flush()
        self._finish()
        return self.files



class ArrowDatasetFiles:
    """A `datasets` save_to_disk folder under `prefix`, written without `datasets`: Arrow IPC stream parts of
    ROW_GROUP_RECORDS-row batches, then state.json and dataset_info.json naming them, which is all load_from_disk
    reads (datasets/arrow_dataset.py, Dataset.load_from_disk, 5.2.0: the parts state.json lists, memory-mapped,
    then `with_format` of its _format_* keys). Parts are published as they fill (part_bytes), so memory holds one
    batch."""

    def __init__(self, destination: Storage, spool: Path, prefix: str, columns: tuple[tuple[str, str], ...],
                 part_bytes: int, format_type: str | None = None) -> None:
        self.destination, self.spool, self.prefix, self.part_bytes = destination, spool, prefix, part_bytes
        self.columns, self.format_type = columns, format_type
        self.schema = pa.schema([(name, arrow_type(kind)) for name, kind in columns]).with_metadata(
            {b"huggingface": schema_metadata(columns)})
        self.files: list[WrittenFile] = []
        self.rows = 0
        self._pending: list[dict[str, Any]] = []
        self._writer: pa.ipc.RecordBatchStreamWriter | None = None
        self._sink: pa.OSFile | None = None
        self._path: Path | None = None
        self._records = 0
        self._tokens = 0

    def write(self, record: dict[str, Any]) -> int:
        """Add a row; returns its index in the dataset."""
        self._pending.append(record)
        self._tokens += len(record.get("input_ids") or ())
        self.rows += 1
        if len(self._pending) >= ROW_GROUP_RECORDS:
            self.flush()
        return self.rows - 1

    def _key(self, index: int) -> str:
        # Not datasets' data-XXXXX-of-NNNNN: the count is known only at the end, and load_from_disk opens the names
        # state.json lists, whatever they are.
        return f"{self.prefix}data-{index:05d}.arrow"

    def flush(self) -> None:
        if not self._pending:
            return
        batch = pa.RecordBatch.from_pylist(self._pending, schema=self.schema)
        self._pending = []
        writer, sink = self._open()
        writer.write_batch(batch)
        self._records += batch.num_rows
        if sink.tell() >= self.part_bytes:
            self._finish()

    def _open(self) -> tuple[pa.ipc.RecordBatchStreamWriter, pa.OSFile]:
        if self._writer is None or self._sink is None:
            self._path = self.spool / self._key(len(self.files)).replace("/", "__")
            self._sink = pa.OSFile(str(self._path), "wb")
            self._writer = pa.ipc.new_stream(self._sink, self.schema)
            self._records = 0
        return self._writer, self._sink

    def _finish(self) -> None:
        if self._writer is None or self._sink is None or self._path is None:
            return
        self._writer.close()
        self._sink.close()
        self._writer = self._sink = None
        self.files.append(publish(self.destination, self._key(len(self.files)), self._path, self._records,
                                  self._tokens))
        self._tokens = 0

    def close(self, fingerprint: str) -> list[WrittenFile]:
        """The last part (an empty one for a dataset of no rows, which load_from_disk still opens), then the two
        JSON files, last, so a folder without them is never a dataset."""
        self.flush()
        if not self.files:
            self._open()
        self._finish()
        state: dict[str, Any] = {"_data_files": [{"filename": f.path.removeprefix(self.prefix)} for f in self.files],
                 "_fingerprint": fingerprint, "_format_columns": None, "_format_kwargs": {},
                 "_format_type": self.format_type, "_output_all_columns": False, "_split": None}
        info = {"citation": "", "description": "", "features": features(self.columns), "homepage": "", "license": ""}
        for name, document in (("dataset_info.json", info), ("state.json", state)):
            self.destination.put(f"{self.prefix}{name}", orjson.dumps(document, option=orjson.OPT_INDENT_2))
        return self.files
