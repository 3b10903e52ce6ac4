"""`tokenmill export --format vocab`: draft-vocabulary maps for every trainer, from the run's loss-token counts.

The counts are the committed shards' own (store/token_counts.py: written with each shard, read through the markers
that count, a shard recounted from its rows where a slot was committed twice), so no sample is read again unless a
filter asks: a unit filter (--finish-reason, --exclude-truncated, --require-reasoning) recounts every shard from its
rows, through the same generation units and validity rule the token exports write; --exclude-eval-overlap recounts
only the shards holding an overlapping prompt; --per-conversation counts from the rows too (a conversation is then one
record, which changes the order SpecForge meets ids in). Datasets are merged in spec order, each count times its
--weight.

Files, at the top of DEST (one set per --draft-vocab-size N):

    token_freq.pt                      speculators: torch.save({id: count}) (--token-freq-path)
    d2t-N.npy, t2d-N.npy               speculators: np.save of d2t (int64) and t2d (bool) (--d2t-path, --t2d-path)
    specforge-vocab-mapping-N.pt       SpecForge: torch.save({"d2t", "t2d"}) (model.vocab_mapping_path)
    sglang-token-map-N.pt              SGLang: torch.save([hot ids]) (--speculative-token-map)
    export.json                        what was counted, the coverage of each size, the files and their flags

Each trainer's own tie order decides which ids a size keeps (export/vocab_maps.py). `.pt` files are written without
torch (export/ckpt.py).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from ..stats.token_freq import REPORT_SIZES, TokenFrequencies, count_units
from ..store.storage import Storage
from ..store.token_counts import dataset_frequencies
from .ckpt import Tensor, torch_bytes
from .manifest import MANIFEST, SCHEMA
from .units import GenerationUnit, SlotSeen, invalid_reason, units_from_row
from .vocab_maps import VocabError, ranked_ids, specforge_vocab, speculators_vocab, token_freq_dict

if TYPE_CHECKING:
    from .exporter import ExportRequest

logger = logging.getLogger(__name__)

FORMAT = "vocab"
Rows = Callable[[str], Iterator[dict[str, Any]]]  # a dataset's committed rows, in commit order


class VocabExportError(RuntimeError):
    """The maps cannot be written; the message says what to change (the exporter shows it as an ExportError)."""


def loss_ids(unit: GenerationUnit) -> list[int]:
    """The ids under the unit's loss mask (export/units.py): its output, or each turn's span of a conversation."""
    if unit.spans is None:
        return unit.output_ids
    ids = unit.input_ids
    return [tid for begin, end in unit.spans for tid in ids[begin:end]]


def unit_frequencies(rows: Iterator[dict[str, Any]], request: ExportRequest, vocab_size: int | None,
                     overlapping: set[int]) -> tuple[TokenFrequencies, dict[str, int]]:
    """A dataset's counts over exactly the units a token export writes with these filters (every shard read)."""
    frequencies = TokenFrequencies()
    left_out: dict[str, int] = {}
    seen = SlotSeen()
    for row in rows:
        if not seen.add(int(row["line"]), int(row.get("sample_index") or 0)):
            continue
        pieces = []
        for unit in units_from_row(row, request.per_conversation):
            why = ("eval_overlap" if unit.line in overlapping else
                   request.filters.rejection(unit) or invalid_reason(unit, vocab_size))
            if why:
                left_out[why] = left_out.get(why, 0) + 1
                continue
            pieces.append(np.asarray(loss_ids(unit), dtype=np.int64))
        if pieces:  # one row's units as one shard of units: order of first appearance is kept across rows
            offsets = np.concatenate([[0], np.cumsum([p.size for p in pieces])]).astype(np.int64)
            frequencies.add(count_units(np.concatenate(pieces), offsets))
    return frequencies, left_out


def target_vocab_size(request: ExportRequest, run: dict[str, Any]) -> tuple[int, str]:
    """The target's vocabulary (the rows of its lm_head, which t2d must match): --target-vocab-size, else the
    model's config.json beside the tokenizer run.json records, else the tokenizer's length (which can be smaller:
    the trainers then refuse t2d, naming both sizes)."""
    if request.target_vocab_size is not None:
        return request.target_vocab_size, "--target-vocab-size"
    from ..generate.hidden_pass import model_config
    from ..render.pretokenize import local_model_folder

    tokenizer = run.get("tokenizer") or {}
    location = request.tokenizer or tokenizer.get("location")
    try:
        config = model_config(local_model_folder(location, request.s3_endpoint)) if location else {}
    except (OSError, ValueError) as error:
        logger.warning("cannot read the model's config.json at %s (%s)", location, error)
        config = {}
    nested = config.get("text_config")
    text: dict[str, Any] = nested if isinstance(nested, dict) else config
    size = text.get("vocab_size")
    if isinstance(size, int):
        return size, f"{location}/config.json vocab_size"
    if isinstance(tokenizer.get("vocab_size"), int):
        logger.warning("no config.json vocab_size beside the tokenizer; t2d is sized to the tokenizer's %d ids: pass "
                       "--target-vocab-size with the model's vocab_size if it pads its vocabulary",
                       tokenizer["vocab_size"])
        return int(tokenizer["vocab_size"]), "the tokenizer's length (run.json)"
    raise VocabExportError("the target's vocabulary size is unknown (no config.json beside the tokenizer, none in "
                      "run.json): pass --target-vocab-size")


def _in(lines: set[int]) -> Callable[[int, int], bool]:
    return lambda line, _index: line in lines


def _npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array, allow_pickle=False)
    return out.getvalue()


def _figures(counts: TokenFrequencies, sizes: list[int]) -> dict[str, Any]:
    total = counts.total
    covered = counts.covered(sizes)
    return {"loss_tokens": total, "distinct_ids": counts.distinct,
            "coverage": {str(size): covered[size] / total if total else None for size in sizes}}


def export_vocab(request: ExportRequest, source: Storage, destination: Storage, run: dict[str, Any],
                 datasets: list[str], excluded: dict[str, list[str]], overlapping: dict[str, set[int]],
                 rows: Rows, version: str) -> dict[str, Any]:
    """Count, merge, write every size's files, then export.json (last); returns the manifest."""
    weights = dict(request.weights)
    unknown = sorted(set(weights) - set(datasets))
    if unknown:
        raise VocabExportError(f"--weight names {', '.join(unknown)}, not among the datasets exported "
                          f"({', '.join(datasets)})")
    vocab_size, vocab_from = target_vocab_size(request, run)
    per_dataset: dict[str, TokenFrequencies] = {}
    left_out: dict[str, dict[str, int]] = {}
    for name in datasets:
        lines = overlapping.get(name, set())
        # --per-conversation: SpecForge meets a conversation's ids as one record, so the order they first appear in
        # (its tie order) is the units' own, counted from the rows.
        if request.filters.per_unit or request.per_conversation:
            # the token exports' validity rule: ids within the tokenizer's vocabulary (exporter.Exporter.add_unit)
            per_dataset[name], left_out[name] = unit_frequencies(rows(name), request,
                                                                 (run.get("tokenizer") or {}).get("vocab_size"), lines)
        else:
            per_dataset[name] = dataset_frequencies(source, name, _in(lines) if lines else None)
            left_out[name] = {"eval_overlap_lines": len(lines)} if lines else {}
    mix = TokenFrequencies()
    for name in datasets:
        mix.merge(per_dataset[name], weights.get(name, 1))
    if not mix.total:
        raise VocabExportError("no loss token was counted (no committed sample, or the filters left none)")
    files: dict[str, str] = {}
    usage: list[str] = []
    destination.put("token_freq.pt", torch_bytes(token_freq_dict(mix)))
    files["token_freq.pt"] = "speculators --token-freq-path"
    try:
        for size in request.draft_vocab_sizes:
            usage += _write_size(destination, mix, size, vocab_size, files)
    except VocabError as error:
        raise VocabExportError(str(error)) from None
    sizes = sorted(set(request.draft_vocab_sizes) | set(REPORT_SIZES))
    manifest = {
        "schema": SCHEMA, "format": FORMAT, "created_at": datetime.now(UTC).isoformat(), "tokenmill": version,
        "source": {"uri": source.root_uri, "name": run.get("name")}, "destination": destination.root_uri,
        "options": request.options(), "excluded_datasets": excluded,
        "counted": ("loss-bearing tokens: the ids the target generated in each generation, the stop token included "
                    "(the loss mask's 1s in the token exports)"),
        "target_vocab_size": vocab_size, "target_vocab_size_from": vocab_from,
        "draft_vocab_sizes": list(request.draft_vocab_sizes),
        "weights": {name: weights.get(name, 1) for name in datasets},
        "datasets": {name: {**_figures(per_dataset[name], sizes), "left_out": left_out[name]} for name in datasets},
        "mix": _figures(mix, sizes), "files": files, "usage": usage,
    }
    destination.put(MANIFEST, orjson.dumps(manifest, option=orjson.OPT_INDENT_2))
    return manifest


def _write_size(destination: Storage, mix: TokenFrequencies, size: int, vocab_size: int,
                files: dict[str, str]) -> list[str]:
    speculators = speculators_vocab(mix, size, vocab_size)
    destination.put(f"d2t-{size}.npy", _npy(speculators.d2t))
    destination.put(f"t2d-{size}.npy", _npy(speculators.t2d))
    specforge = specforge_vocab(mix, size, vocab_size)
    destination.put(f"specforge-vocab-mapping-{size}.pt", torch_bytes({
        "d2t": Tensor("int64", (size,), specforge.d2t.astype("<i8").tobytes()),
        "t2d": Tensor("bool", (vocab_size,), specforge.t2d.tobytes())}))
    destination.put(f"sglang-token-map-{size}.pt", torch_bytes(ranked_ids(mix, size, vocab_size)))
    files.update({f"d2t-{size}.npy": "speculators --d2t-path", f"t2d-{size}.npy": "speculators --t2d-path",
                  f"specforge-vocab-mapping-{size}.pt": "SpecForge model.vocab_mapping_path",
                  f"sglang-token-map-{size}.pt": "SGLang --speculative-token-map (EAGLE/EAGLE-2 drafters)"})
    dest = destination.root_uri.rstrip("/")
    return [f"speculators train ... --draft-vocab-size {size} --d2t-path {dest}/d2t-{size}.npy --t2d-path "
            f"{dest}/t2d-{size}.npy (or --token-freq-path {dest}/token_freq.pt)",
            f"SpecForge: model.vocab_mapping_path: {dest}/specforge-vocab-mapping-{size}.pt (draft config "
            f"draft_vocab_size: {size})",
            f"SGLang (EAGLE/EAGLE-2 drafter of {size} ids): --speculative-token-map {dest}/sglang-token-map-{size}.pt"]


def summary_lines(manifest: dict[str, Any]) -> list[str]:
    sizes = [str(size) for size in manifest["draft_vocab_sizes"]]
    lines = [f"target vocabulary: {manifest['target_vocab_size']} ({manifest['target_vocab_size_from']})",
             "coverage of the loss tokens by the top ids, per draft vocabulary size:"]
    for name, figures in [*manifest["datasets"].items(), ("mix", manifest["mix"])]:
        shares = ", ".join(f"{size}: {figures['coverage'][size]:.2%}" for size in sizes)
        lines.append(f"  {name}: {figures['loss_tokens']:,} loss tokens, {figures['distinct_ids']:,} distinct ids; "
                     f"{shares}")
    lines += [f"wrote {name} ({reader})" for name, reader in manifest["files"].items()]
    return lines + manifest["usage"]
