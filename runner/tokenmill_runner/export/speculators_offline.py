"""`tokenmill export --format speculators-offline`: speculators 0.9.0's offline EAGLE-3 data from the run's states.

What its ArrowDataset reads (`SP` = speculators 0.9.0, train/data.py; `HS` = hs-connectors 0.9.0, transfer.py):
- `load_from_disk(datapath)` (SP data.py:164): a `datasets` save_to_disk folder, here DEST/dataset/, whose rows
  hold `seq_len` (the lengths it batches by, data.py:225), `input_ids` and `loss_mask` (data.py:314, 332). The row's
  input_ids go to `torch.equal` (data.py:314), so state.json names the torch format, as prepare-data saves it
  (SP data_generation/preprocessing.py:638, cli/prepare_data.py:243).
- `FileTransfer(datapath / "hidden_states").get_cached(i)` (SP data.py:184, 276; HS transfer.py:124-143):
  hidden_states/hs_{i}.safetensors for row i, read with safetensors' load_file: `token_ids` [n] and `hidden_states`
  [n, layers, hidden]. A file whose token_ids differ from the row's input_ids is skipped (data.py:314-322);
  `hidden_states[:, :-1]` are the aux layers, `[:, -1]` the verifier's final state before its norm (data.py:325-334).

tokenmill's stored states file is that file (store/hidden_states.py: token_ids int64, hidden_states in the served
dtype, the sample's id in its metadata), so it is copied byte for byte once its digest and ids are checked. With
`storage: fp8` it is hs-connectors' fp8 file (float8_e4m3fn values and `hidden_states_scales`), which speculators
reads through `FP8Transfer` (`--hidden-states-backend fp8`, HS transfer.py:212-300): dequantized to bf16 on read. Its
last layer is the pre-norm final state only when the run captured id L - 1 last on a model that serves it
(facts/hidden_states.check_layouts, checked by the planner and the capture pass for `layouts: [speculators]`), so
the run's spec must name the layout. Rows are every selected dataset's samples, in spec and commit order; a sample
without states is left out and counted. One sample's file is in memory at a time.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from ..facts.hidden_states import AUX_LAST_LAYOUTS
from ..store.hidden_states import AUX, parse_state_file, read_state_file
from ..store.storage import Storage
from .formats import FORMATS, SPECULATORS_COLUMNS, speculators_row
from .offline import captured_samples, new_counts, sequence_unit, write_manifest
from .writers import ArrowDatasetFiles

FORMAT = FORMATS["speculators-offline"]
FOLDER = "dataset"
STATES = "hidden_states"


class SpeculatorsLayoutError(ValueError):
    """The run's states are not speculators' layout; the message says what to capture."""


def check_run_layout(run: dict[str, Any]) -> int:
    """The layers per token the run's spec captured for speculators' layout; raises SpeculatorsLayoutError when its
    spec did not ask for the layout (its last layer is then an aux layer, not the final state)."""
    states = (run.get("spec") or {}).get("hiddenStates") or {}
    layer_ids = states.get("layerIds")
    if not AUX_LAST_LAYOUTS.intersection(states.get("layouts") or []) or not layer_ids:
        raise SpeculatorsLayoutError(
            "--format speculators-offline: the run's spec.hiddenStates does not name layouts: [speculators], so its "
            "last captured layer is an aux layer, not the target's pre-norm final state that speculators reads as "
            "verifier_last_hidden_states; capture with layouts: [speculators] and layerIds [1, L/2-1, L-4, L-1] "
            "(docs/export.md)")
    return len(layer_ids)


def export_speculators_offline(source: Storage, destination: Storage, datasets: list[str], run: dict[str, Any],
                               spool: Path, part_bytes: int, version: str) -> dict[str, Any]:
    """Write the Arrow dataset, each row's states file and the manifest (export.json, last); returns the manifest.
    `spool` holds the Arrow part being written (beside the destination when it is local: publishing is a rename)."""
    layers = check_run_layout(run)
    rows = ArrowDatasetFiles(destination, spool, f"{FOLDER}/", SPECULATORS_COLUMNS, part_bytes, "torch")
    digest = hashlib.sha256()
    summary: dict[str, dict[str, Any]] = {}
    for dataset in datasets:
        counts = summary[dataset] = {**new_counts((AUX,)), "first_row": rows.rows}
        for _, row, markers in captured_samples(source, dataset, (AUX,), counts):
            data = read_state_file(source, dataset, markers["aux"])
            token_ids, _, shape = parse_state_file(data)
            try:
                unit, _ = sequence_unit(row, {"aux": (token_ids, shape)})
                if shape[1] != layers:
                    raise ValueError(f"its states hold {shape[1]} layers and the run's layerIds {layers}")
            except ValueError as error:
                counts["refused"].append(f"sample {row['sample_id']!r}: {error}")
                continue
            index = rows.write(speculators_row(unit))
            destination.put(f"{FOLDER}/{STATES}/hs_{index}.safetensors", data)
            digest.update(markers["aux"]["sha256"].encode())
            counts["written"] += 1
            counts["bytes"] += len(data)
    files = rows.close(digest.hexdigest()[:16])
    fp8 = ((run.get("spec") or {}).get("hiddenStates") or {}).get("storage") == "fp8"
    usage = (f"speculators train --data-path {destination.uri(FOLDER)} --on-missing raise --verifier-name-or-path "
             f"<target>{' --hidden-states-backend fp8' if fp8 else ''} (its default target layer ids [2, L//2, L-3] "
             "are the captured aux layers)")
    return write_manifest(destination, FORMAT.name, source.root_uri, version, summary, usage,
                          files=[f.__dict__ for f in files], rows=rows.rows)
