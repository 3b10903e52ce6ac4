"""The run manifest (`run.json`): what a run is, in one schema every reader shares. Pure: bytes in and out.

It says who owns the output (a DatasetGeneration by namespace/name/uid, or a `tokenmill run` on a machine), the
hash of the spec the writing Job was built from, and the layout: per dataset the source's identity, its rows
(lines), `limit`, `samples`, input mapping, and the seed rule. The runner writes it before any shard of the layout
it describes; the operator, the report, export and inspect read it here and nowhere else. A reader that needs to
know whether committed work is the *current* run's compares `spec_hash` with the hash it expects: a Job that ended
before its runner recorded its layout left the previous run's manifest, which is not its work.

Version 1 files (before owners and hashes) still read: their owner and hash are None.
"""

from __future__ import annotations

import base64
import zlib
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .bounds import MAX_DATASETS, MAX_SLOTS, OverBound, check_name, check_values
from .ledger import MAX_SAMPLES_PER_PROMPT, Completeness, DatasetLedger

if TYPE_CHECKING:
    from .storage import Storage

MANIFEST = "run.json"
VERSION = 2


class ManifestError(ValueError):
    """run.json exists but cannot be read as a manifest."""


class Owner(BaseModel):
    """Who writes the output. A DatasetGeneration is one owner across its Jobs (its uid tells a re-created resource
    of the same name apart); a `tokenmill run` is owned by its spec's name on one machine."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    kind: Literal["DatasetGeneration", "cli"]
    name: str
    namespace: str | None = None
    uid: str | None = None

    def describe(self) -> str:
        if self.kind == "cli":
            return f"tokenmill run {self.name!r}"
        return f"DatasetGeneration {self.namespace}/{self.name} (uid {self.uid})"


class SourceIdentity(BaseModel):
    """Enough to tell a replaced source from the one a run committed against: its size, the store's version (ETag or
    mtime), a hash of its first block (of the shard names and sizes, and the first shard's first block, for a
    folder of shards) and a hash of its whole content, computed by the scan, which reads every byte anyway. The
    scan is cached by the store's version (`scan_cache.py`), so a changed version means a new scan and so a new
    content hash: an edit anywhere (a row removed, another of the same length appended) is seen before committed
    outcomes are trusted."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    uri: str
    size: int | None = None
    version: str | None = None  # ETag on S3, mtime locally
    head_hash: str | None = None  # BLAKE2b of the first block
    content_hash: str | None = None  # BLAKE2b of every byte (each shard's name and bytes, in order)

    def differs(self, other: SourceIdentity) -> str | None:
        """What changed between two identities of one source, or None. A version alone (a re-upload of the same
        bytes changes the ETag) does not count when the content hash agrees. A manifest written before content
        hashes were recorded has only the first block's to compare."""
        if self.size is not None and other.size is not None and self.size != other.size:
            return f"its size changed from {self.size} to {other.size} bytes"
        if self.head_hash and other.head_hash and self.head_hash != other.head_hash:
            return "its content changed (the hash of its first block differs)"
        if self.content_hash and other.content_hash and self.content_hash != other.content_hash:
            return "its content changed (the hash of all its bytes differs, at the same size)"
        return None


def encode_lines(lines: np.ndarray) -> str:
    """A bool per line as text for run.json: the bitmap, zlib-compressed, base64 (a double-spaced file of ten
    million lines takes a few kilobytes, not a number per line)."""
    return base64.b64encode(zlib.compress(np.packbits(lines, bitorder="little").tobytes(), 9)).decode()


def decode_bits(text: str, lines: int) -> np.ndarray:
    """`encode_lines` read back as a bit per line of 1..lines (little-endian, zero past what was written); bounded:
    never more than lines/8 bytes are inflated."""
    size = -(-lines // 8)
    try:
        packed = zlib.decompressobj().decompress(base64.b64decode(text, validate=True), size)
    except (ValueError, zlib.error) as error:
        raise ManifestError(f"a dataset's skipped lines are not an encoded bitmap: {error}") from None
    bits = np.zeros(size, dtype=np.uint8)
    bits[:len(packed)] = np.frombuffer(packed, dtype=np.uint8)
    if lines & 7:
        bits[-1] &= (1 << (lines & 7)) - 1
    return bits


def decode_lines(text: str, lines: int) -> np.ndarray:
    """`encode_lines` read back, a bool per line of 1..lines."""
    return np.unpackbits(decode_bits(text, lines), bitorder="little", count=lines).astype(bool)


class DatasetLayout(BaseModel):
    """One dataset of the run: the slots are (line, sample index 0..samples-1) for each line of 1..`lines` that
    yields a row: lines are numbered as they are in the file, and a JSONL source's blank lines yield none (they are
    `skipped`). Without blank lines (and in manifests written before they were recorded) that is lines 1..rows."""

    model_config = ConfigDict(extra="allow")
    # Bounded before any reader sizes a ledger from them (bounds.py): rows 500000000 in 105 bytes took the operator to
    # 5.9 GB.
    rows: int = Field(ge=0, le=MAX_SLOTS)  # rows the source yields within `limit`
    samples: int = Field(1, ge=1, le=MAX_SAMPLES_PER_PROMPT)
    lines: int | None = Field(None, ge=0, le=MAX_SLOTS)  # the highest line that yields a row (None: rows)
    skipped: str | None = None  # `encode_lines` of the lines of 1..lines that yield no row (None: none)
    skipped_lines: int = 0  # how many those are (for people reading run.json)
    limit: int | None = None
    source: SourceIdentity | None = None
    input: dict[str, Any] = Field(default_factory=dict)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    sampling: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _bounded(self) -> DatasetLayout:
        if self.last_line * self.samples > MAX_SLOTS:
            raise ValueError(f"{self.last_line} lines x {self.samples} samples are over the {MAX_SLOTS} slots a "
                             "dataset may have; write a job this large as several runs")
        return self

    @property
    def slots(self) -> int:
        return self.rows * self.samples

    @property
    def last_line(self) -> int:
        return self.rows if self.lines is None else self.lines

    def within(self) -> np.ndarray | None:
        """A bool per line of 1..last_line: whether it is a slot's line (None: every one)."""
        if not self.skipped:
            return None
        return ~decode_lines(self.skipped, self.last_line)

    def within_bits(self) -> np.ndarray | None:
        """`within` as a bit per line (little-endian), as `DatasetLedger.completeness` takes it: an eighth of a
        byte per line, never a byte."""
        if not self.skipped:
            return None
        return ~decode_bits(self.skipped, self.last_line)

    def completeness(self, ledger: DatasetLedger | None) -> Completeness:
        """The layout's slots and their outcomes in `ledger` (None: nothing committed): what the report, the
        operator and `tokenmill run` call settled."""
        return (ledger or DatasetLedger()).completeness(self.last_line, self.samples, self.within_bits())


class RunManifest(BaseModel):
    model_config = ConfigDict(extra="allow")
    version: int = VERSION
    tokenmill: str | None = None
    owner: Owner | None = None
    spec_hash: str | None = None
    name: str | None = None
    started_at: str | None = None
    spec: dict[str, Any] = Field(default_factory=dict)
    tokenizer: dict[str, Any] = Field(default_factory=dict)
    context_length: int | None = None
    datasets: dict[str, DatasetLayout] = Field(default_factory=dict)
    # Datasets an earlier layout had and this one does not: their commits stay in the output, and their source
    # identity is kept so that adding one back over another file is refused like any replaced source.
    retired: dict[str, DatasetLayout] = Field(default_factory=dict)
    workers: int = 1
    seeds: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _bounded(self) -> RunManifest:
        """Names that become folders and file names, and counts that size every reader's ledgers, checked before
        any reader uses them (bounds.py)."""
        for table in (self.datasets, self.retired):
            if len(table) > MAX_DATASETS:
                raise ValueError(f"{len(table)} datasets, over the {MAX_DATASETS} a run may have")
        for name in (*self.datasets, *self.retired, *self._spec_names()):
            check_name(name, "run.json")
        slots = sum(layout.last_line * layout.samples for layout in self.datasets.values())
        if slots > MAX_SLOTS:
            raise ValueError(f"the layouts hold {slots} slots together, over the {MAX_SLOTS} a run may have; write a "
                             "job this large as several runs")
        return self

    def _spec_names(self) -> list[Any]:
        datasets = self.spec.get("datasets", [])
        if not isinstance(datasets, list):
            raise ValueError("spec.datasets is not a list")
        if len(datasets) > MAX_DATASETS:
            raise ValueError(f"spec.datasets has {len(datasets)} datasets, over the {MAX_DATASETS} a run may have")
        return [d["name"] for d in datasets if isinstance(d, dict) and "name" in d]

    @property
    def dataset_names(self) -> list[str]:
        """The spec's datasets in spec order (the layout's keys when the spec names none)."""
        named = [d["name"] for d in self.spec.get("datasets", []) if isinstance(d, dict) and "name" in d]
        return named or list(self.datasets)

    @property
    def model(self) -> dict[str, Any]:
        return self.spec.get("model") or {}

    def encode(self) -> bytes:
        return orjson.dumps(self.model_dump(mode="json", exclude_none=True), option=orjson.OPT_INDENT_2)


def retire(recorded: RunManifest | None, current: dict[str, DatasetLayout]) -> dict[str, DatasetLayout]:
    """The layouts of datasets the recorded run had and the current spec does not (kept as `retired`)."""
    if recorded is None:
        return {}
    earlier = {**recorded.retired, **recorded.datasets}
    return {name: layout for name, layout in earlier.items() if name not in current}


# A few KB per dataset; the operator reads it on every pass, so a tenant's 300 MiB run.json must not be read whole.
MANIFEST_BYTES = 16 * 1024 * 1024
# run.json is a spec, a tokenizer's facts and a layout per dataset: a few thousand JSON values. 16 MiB of `{},` would
# parse into 5.6 million dicts (604 MB in the operator); this many values is 10 MB at most.
MANIFEST_VALUES = 100_000


def decode(data: bytes, where: str = MANIFEST) -> RunManifest:
    """The manifest in `data`, every bound checked (bounds.py), or ManifestError naming what is wrong."""
    try:
        check_values(data, MANIFEST_VALUES, where)
        return RunManifest.model_validate(orjson.loads(data))
    except OverBound as error:
        raise ManifestError(str(error)) from error
    except (orjson.JSONDecodeError, ValueError) as error:
        raise ManifestError(f"{where} is not a tokenmill run manifest: {error}") from error


def read_manifest(storage: Storage) -> RunManifest | None:
    """The output's manifest, or None where no run has recorded one yet."""
    if not storage.exists(MANIFEST):
        return None
    with storage.open_read(MANIFEST) as body:  # never more than the cap (bounded_get.py: whoever writes the prefix)
        data = body.read(MANIFEST_BYTES + 1)
    if len(data) > MANIFEST_BYTES:
        raise ManifestError(f"{storage.uri(MANIFEST)} is over the {MANIFEST_BYTES} bytes a run manifest may have; it "
                            "was not read further")
    return decode(data, storage.uri(MANIFEST))


def write_manifest(storage: Storage, manifest: RunManifest) -> None:
    storage.put(MANIFEST, manifest.encode())


def model_conflict(recorded: RunManifest | None, model_path: str, tokenizer: str) -> str | None:
    """Why an output recorded for another model or tokenizer must not take this run's samples, or None."""
    if recorded is None:
        return None
    model = recorded.model
    theirs = {"path": model.get("path"), "tokenizer": model.get("tokenizer") or model.get("path")}
    for key, ours in (("path", model_path), ("tokenizer", tokenizer)):
        if theirs[key] is not None and theirs[key] != ours:
            return (f"the output records a run with model.{key} {theirs[key]!r}, not {ours!r}: outputs of two "
                    "runs must not mix; write this one to another output URI")
    return None


def layout_changes(recorded: RunManifest | None, current: dict[str, DatasetLayout],
                   committed: dict[str, int]) -> list[str]:
    """Edits that would re-map committed outcomes onto other prompts: a dataset with commits whose source content or
    input mapping changed. (`samples` and `limit` may change: the layout says which slots are current.)"""
    if recorded is None:
        return []
    problems = []
    for name, layout in current.items():
        before = recorded.datasets.get(name) or recorded.retired.get(name)
        if before is None or not committed.get(name):
            continue
        if before.source is not None and layout.source is not None:
            why = before.source.differs(layout.source)
            if why:
                problems.append(f"datasets[{name}].source {layout.source.uri}: {why} since {committed[name]} "
                                "slots were committed against it")
        if before.input and layout.input and before.input != layout.input:
            problems.append(f"datasets[{name}].input changed from {before.input} to {layout.input} after "
                            f"{committed[name]} slots were committed")
    return problems
