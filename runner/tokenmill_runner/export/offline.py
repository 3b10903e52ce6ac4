"""`tokenmill export --format specforge-offline`: SpecForge's offline EAGLE-3 features from the run's captured states.

One `.ckpt` per committed sample that has both kinds of states (store/hidden_states.py: the aux layers and the final
state of the second pass), under features/<dataset>/<key>.ckpt, holding what SpecForge's own capture writes
(SF data/preprocessing.py:640-666, OfflineEagle3Dataset.process_data): `input_ids` [n] int64, `loss_mask` [n] int64
(1 on the generated tokens, export/units.py), `hidden_state` [1, n, hidden] (the final state) and `aux_hidden_state`
[1, n, layers * hidden], in the served dtype. The states' bytes are copied as stored, never converted, and the ids the
states were captured for must equal the row's, or the sample is refused. One sample is in memory at a time.

The walk over the captured samples (`captured_samples`: a sample without every kind is left out and counted, and the
export then exits 3), the ids check (`sequence_unit`) and the manifest are shared with speculators-offline
(export/speculators_offline.py).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from ..store.hidden_states import (
    AUX,
    FINAL,
    StateKind,
    committed_samples,
    read_state_bytes,
    sample_key,
    state_markers,
)
from ..store.storage import Storage
from .ckpt import Tensor, write_ckpt
from .units import GenerationUnit, units_from_row

logger = logging.getLogger(__name__)
FOLDER = "features"
MISSING_SHOWN = 20


def new_counts(kinds: tuple[StateKind, ...]) -> dict[str, Any]:
    """A dataset's counts in the manifest: samples, those written and their bytes, those without each kind."""
    return {"samples": 0, "written": 0, "bytes": 0, **{f"without_{kind.name}": 0 for kind in kinds},
            "refused": [], "missing": []}


def captured_samples(source: Storage, dataset: str, kinds: tuple[StateKind, ...], counts: dict[str, Any]
                     ) -> Iterator[tuple[str, dict[str, Any], dict[str, dict[str, Any]]]]:
    """(key, row, {kind: its state marker}) of each committed sample that has every kind, in commit order; the
    others are counted under `without_<kind>` (the first kind missing) and the first few named."""
    markers = {kind.name: {sample_key(m["sample_id"], m["sample_index"]): m
                           for m in state_markers(source, dataset, kind)} for kind in kinds}
    for key, row in committed_samples(source, dataset):
        counts["samples"] += 1
        lacking = [kind.name for kind in kinds if key not in markers[kind.name]]
        if lacking:
            counts[f"without_{lacking[0]}"] += 1
            if len(counts["missing"]) < MISSING_SHOWN:
                counts["missing"].append(row["sample_id"])
            continue
        yield key, row, {name: by_key[key] for name, by_key in markers.items()}


def sequence_unit(row: dict[str, Any], states: dict[str, tuple[np.ndarray, tuple[int, ...]]]
                  ) -> tuple[GenerationUnit, np.ndarray]:
    """The unit the states were captured for (the row's whole last sequence) and its ids as int64. Raises
    ValueError when a kind's states were captured for other ids (`states`: kind -> its token ids and shape)."""
    unit = list(units_from_row(row, per_conversation=True))[-1]  # the states cover the last (whole) sequence
    ids = np.asarray(unit.input_ids, dtype="<i8")
    for name, (token_ids, shape) in states.items():
        if not np.array_equal(token_ids, ids) or shape[0] != len(ids):
            raise ValueError(f"its {name} states were captured for {len(token_ids)} token ids that differ from "
                             f"the row's {len(ids)}")
    return unit, ids


def sample_tensors(row: dict[str, Any], aux: tuple[np.ndarray, bytes, tuple[int, ...]],
                   final: tuple[np.ndarray, bytes, tuple[int, ...]], dtype: str) -> dict[str, Tensor]:
    """The four tensors of one sample. Raises ValueError when the states were not captured for the row's ids."""
    unit, ids = sequence_unit(row, {"aux": (aux[0], aux[2]), "final": (final[0], final[2])})
    n, layers, hidden = aux[2]
    return {"input_ids": Tensor("int64", (n,), ids.tobytes()),
            "loss_mask": Tensor("int64", (n,), np.asarray(unit.loss_mask, dtype="<i8").tobytes()),
            "hidden_state": Tensor(dtype, (1, n, final[2][2]), final[1]),
            "aux_hidden_state": Tensor(dtype, (1, n, layers * hidden), aux[1])}


def export_specforge_offline(source: Storage, destination: Storage, datasets: list[str], source_uri: str,
                             version: str) -> dict[str, Any]:
    """Write every dataset's features and the manifest (export.json, last); returns the manifest."""
    spool = Path(tempfile.mkdtemp(prefix="tokenmill-ckpt-"))
    summary: dict[str, dict[str, Any]] = {}
    try:
        for dataset in datasets:
            counts = summary[dataset] = new_counts((AUX, FINAL))
            for key, row, markers in captured_samples(source, dataset, (AUX, FINAL), counts):
                try:
                    tensors = sample_tensors(row, read_state_bytes(source, dataset, markers["aux"]),
                                             read_state_bytes(source, dataset, markers["final"]),
                                             markers["aux"]["dtype"])
                except ValueError as error:
                    counts["refused"].append(f"sample {row['sample_id']!r}: {error}")
                    continue
                path = spool / f"{key}.ckpt"
                size = write_ckpt(path, tensors)
                destination.put_file(f"{FOLDER}/{dataset}/{key}.ckpt", path)
                path.unlink(missing_ok=True)  # a local destination moves it in
                counts["written"] += 1
                counts["bytes"] += size
    finally:
        shutil.rmtree(spool, ignore_errors=True)
    return write_manifest(destination, "specforge-offline", source_uri, version, summary,
                          f"data.hidden_states_path: {destination.uri(FOLDER)}")


def write_manifest(destination: Storage, name: str, source_uri: str, version: str,
                   summary: dict[str, dict[str, Any]], usage: str, **extra: Any) -> dict[str, Any]:
    """export.json, written last: what makes the export complete."""
    manifest = {"format": name, "source": source_uri, "destination": destination.root_uri,
                "created": datetime.now(UTC).isoformat(), "tokenmill_version": version, "datasets": summary,
                **extra, "usage": usage}
    destination.put("export.json", orjson.dumps(manifest, option=orjson.OPT_INDENT_2))
    return manifest


def summary_lines(manifest: dict[str, Any]) -> list[str]:
    lines = []
    for name, counts in manifest["datasets"].items():
        lines.append(f"{name}: {counts['written']} of {counts['samples']} samples written "
                     f"({counts['bytes']} bytes)")
        if counts.get("without_final"):
            lines.append(f"  {counts['without_aux']} without aux states, {counts['without_final']} without the "
                         "final state (tokenmill run captures them: the final state needs the server relaunched with "
                         "--enable-return-hidden-states; docs/export.md)")
        elif counts["without_aux"]:
            lines.append(f"  {counts['without_aux']} without aux states (tokenmill run captures them; "
                         "--retry-failed retries failed captures)")
        lines.extend(f"  refused: {reason}" for reason in counts["refused"][:MISSING_SHOWN])
    if written(manifest):  # no hint for features an empty export never wrote
        lines.append(manifest["usage"])
    return lines


def written(manifest: dict[str, Any]) -> int:
    return sum(int(c["written"]) for c in manifest["datasets"].values())


def incomplete(manifest: dict[str, Any]) -> bool:
    return any(c["written"] < c["samples"] for c in manifest["datasets"].values())
