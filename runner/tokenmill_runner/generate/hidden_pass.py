"""`tokenmill run`'s hidden-state pass after the generation stream: which states the server serves (the aux layers,
or the final state when started with --enable-return-hidden-states alone) and the prefill chunk from its facts
(through a gateway, a worker's: generate/discovery.py), the shape from the model's config.json, then
generate/hidden_capture.py over each dataset. SpecForge's layout needs both kinds, so a second pass against the
relaunched server (the operator's, or `tokenmill run` again) captures the final state; `pending_kinds` says what a
run still lacks."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path

import numpy as np

from ..facts.hidden_states import (
    ServedKind,
    StateShape,
    check_room,
    kinds_needed,
    launch_flags,
    served_kind,
    shape_from_config,
)
from ..render.pretokenize import local_model_folder
from ..spec.config import RunnerConfig
from ..spec.resource import DatasetGenerationSpec, SpecError
from ..store.bounded_get import CONFIG_BYTES, get_bounded
from ..store.capture_progress import ProgressBeat
from ..store.hidden_states import KINDS, StateKind, captured_keys, expected_lengths, sample_key, state_key
from ..store.markers import markers_in_commit_order
from ..store.shards import Fence
from ..store.storage import LocalStorage, Storage
from .discovery import discover
from .hidden_capture import CaptureSummary, capture_dataset

logger = logging.getLogger(__name__)
DEFAULT_CHUNK = 8192  # SGLang's chunked_prefill_size when its facts do not say
_KIND_POLL_S = 5.0


class StatesNotServed(RuntimeError):
    """The server answers without the states this pass wants (not started with the flags, or not rolled yet)."""


async def _served(server: str, api_key: str | None, wanted: ServedKind | None, wait_s: float
                  ) -> tuple[ServedKind, dict[str, object]]:
    """The kind the server serves and its facts; with `wanted`, waits up to `wait_s` for a server rolling to it
    (the operator relaunches the server for the final pass while the runner Job starts)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        info = (await discover(server, api_key, wait_s=wait_s)).info
        kind = served_kind(info)
        if wanted is None:
            # Facts that name neither flag (a server that is not started for states, or facts without the keys)
            # get the aux pass: a server that refuses it fails each capture, recorded for --retry-failed.
            return kind or "aux", info
        if kind == wanted:
            return kind, info
        if loop.time() >= deadline:
            flags = " ".join(launch_flags(None, wanted or "aux"))
            raise StatesNotServed(f"the server at {server} serves {kind or 'no'} hidden states, and this pass wants "
                                  f"{wanted or 'aux or final'} states: start it with {flags}")
        logger.info("the server serves %s hidden states; waiting for it to serve %s", kind, wanted)
        await asyncio.sleep(_KIND_POLL_S)


def model_config(folder: str | None) -> dict[str, object]:
    """The target's config.json beside its tokenizer, read bounded (the user's file); {} when there is none
    (shape_from_config then says so)."""
    if not folder or not (Path(folder) / "config.json").exists():
        return {}
    loaded: dict[str, object] = json.loads(get_bounded(LocalStorage(Path(folder)), "config.json", CONFIG_BYTES))
    return loaded


def refuse_unservable(spec: DatasetGenerationSpec, folder: str | None) -> None:
    """Before the stream: what the pass after it would refuse from config.json (layer ids past the model's layers, a
    layout the architecture cannot serve), so no GPU time is spent generating samples whose states cannot be
    captured. Without a config.json here the pass finds out later (the tokenizer may come from elsewhere)."""
    states = spec.hidden_states
    config = model_config(folder)
    if states is None or not config:
        return
    try:
        shape_from_config(config, states.layer_ids, states.dtype, layouts=states.layouts)
    except ValueError as error:
        raise SpecError(f"spec.hiddenStates: {error}") from None


async def run_hidden_state_pass(config: RunnerConfig, storage: Storage, api_key: str | None,
                                fence: Fence | None = None) -> CaptureSummary:
    """Capture every dataset's missing states of the kind the server serves (config.states_pass: that kind only);
    `fence` is the generation stream's (LeaseLost once it fails)."""
    spec = config.spec
    assert spec.hidden_states is not None
    server = config.servers[0].rstrip("/")
    served, info = await _served(server, api_key, config.states_pass, config.server_wait_s)
    kind = KINDS[served]
    folder = await asyncio.to_thread(local_model_folder, spec.model.tokenizer or spec.model.path,
                                     spec.output.endpoint)
    shape = shape_from_config(model_config(folder), spec.hidden_states.layer_ids, spec.hidden_states.dtype, served,
                              spec.hidden_states.layouts, spec.hidden_states.storage)
    chunk = info.get("chunked_prefill_size")
    chunk = chunk if isinstance(chunk, int) and chunk > 0 else DEFAULT_CHUNK
    _check_local_room(storage, [d.name for d in spec.datasets], shape, kind)
    total = CaptureSummary(kind=served)
    beat = ProgressBeat(storage, served, config.worker_index)
    for dataset in spec.datasets:
        part = await capture_dataset(storage, dataset.name, server, shape, api_key=api_key,
                                     chunked_prefill_tokens=chunk, retry_failed=config.retry_failed,
                                     worker=config.worker_index if config.worker_count > 1 else None,
                                     fence=fence, kind=kind, beat=beat)
        total.captured += part.captured
        total.skipped += part.skipped
        total.failed += part.failed
        total.state_bytes += part.state_bytes
        total.failures += part.failures
    logger.info("%s hidden states: %d captured, %d already committed, %d failed (%d bytes of states)",
                served, total.captured, total.skipped, total.failed, total.state_bytes)
    return total


def pending_kinds(storage: Storage, datasets: list[str], layouts: list[str]) -> list[ServedKind]:
    """The kinds of states the spec's layouts need that some committed sample still lacks."""
    needed = kinds_needed(layouts)
    pending: set[ServedKind] = set()
    for dataset in datasets:
        # The samples' keys from the shard markers once per dataset; each kind's committed keys are one listing.
        keys = {sample_key(sid, index) for marker in markers_in_commit_order(storage, dataset)
                for sid, index in zip(marker["samples"]["sample_id"], marker["samples"]["sample_index"], strict=True)}
        pending.update(name for name in needed if keys - captured_keys(storage, dataset, KINDS[name]))
    return [name for name in needed if name in pending]


def _check_local_room(storage: Storage, datasets: list[str], shape: StateShape, kind: StateKind) -> None:
    """Refuse the pass before any request when a local output cannot hold the files still to be written (their
    exact sizes, from the committed rows' token counts)."""
    if not isinstance(storage, LocalStorage):
        return
    needed = 0
    for dataset in datasets:
        keys, lengths = expected_lengths(storage, dataset)
        done = np.isin(keys, np.fromiter((state_key(key) for key in captured_keys(storage, dataset, kind)),
                                         dtype=np.uint64))
        needed += sum(shape.file_bytes(int(tokens)) for tokens in lengths[~done & (lengths >= 0)].tolist())
    check_room(needed, shutil.disk_usage(storage.root).free, f"the output {storage.root_uri}")
