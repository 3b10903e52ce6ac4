"""`tokenmill run`'s hidden-state pass after the generation stream: the shape from the model's config.json, the
prefill chunk from the server's facts (through a gateway, a worker's: generate/discovery.py), then generate/hidden_capture.py over each dataset."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path

from ..facts.hidden_states import StateShape, check_room, shape_from_config
from ..render.pretokenize import local_model_folder
from ..spec.config import RunnerConfig
from ..store.hidden_states import captured_keys, hidden_state_inputs, sample_key
from ..store.shards import Fence
from ..store.storage import LocalStorage, Storage
from .discovery import discover
from .hidden_capture import CaptureSummary, capture_dataset

logger = logging.getLogger(__name__)
DEFAULT_CHUNK = 8192  # SGLang's chunked_prefill_size when its facts do not say


async def run_hidden_state_pass(config: RunnerConfig, storage: Storage, api_key: str | None,
                                fence: Fence | None = None) -> CaptureSummary:
    """Capture every dataset's missing states; `fence` is the generation stream's (LeaseLost once it fails)."""
    spec = config.spec
    assert spec.hidden_states is not None
    folder = await asyncio.to_thread(local_model_folder, spec.model.tokenizer or spec.model.path,
                                     spec.output.endpoint)
    model_config = json.loads((Path(folder) / "config.json").read_text()) if folder else {}
    shape = shape_from_config(model_config, spec.hidden_states.layer_ids, spec.hidden_states.dtype)
    server = config.servers[0].rstrip("/")
    chunk = (await discover(server, api_key, wait_s=config.server_wait_s)).info.get("chunked_prefill_size")
    chunk = chunk if isinstance(chunk, int) and chunk > 0 else DEFAULT_CHUNK
    _check_local_room(storage, [d.name for d in spec.datasets], shape)
    total = CaptureSummary()
    for dataset in spec.datasets:
        part = await capture_dataset(storage, dataset.name, server, shape, api_key=api_key,
                                     chunked_prefill_tokens=chunk, retry_failed=config.retry_failed,
                                     worker=config.worker_index if config.worker_count > 1 else None,
                                     fence=fence)
        total.captured += part.captured
        total.skipped += part.skipped
        total.failed += part.failed
        total.state_bytes += part.state_bytes
        total.failures += part.failures
    logger.info("hidden states: %d captured, %d already committed, %d failed (%d bytes of states)",
                total.captured, total.skipped, total.failed, total.state_bytes)
    return total


def _check_local_room(storage: Storage, datasets: list[str], shape: StateShape) -> None:
    """Refuse the pass before any request when a local output cannot hold the files still to be written (their
    exact sizes, from the committed rows' token counts)."""
    if not isinstance(storage, LocalStorage):
        return
    needed = 0
    for dataset in datasets:
        expected, _, _ = hidden_state_inputs(storage, dataset)
        done = captured_keys(storage, dataset)
        needed += sum(shape.file_bytes(tokens) for (sid, index), tokens in expected.items()
                      if tokens is not None and sample_key(sid, index) not in done)
    check_room(needed, shutil.disk_usage(storage.root).free, f"the output {storage.root_uri}")
