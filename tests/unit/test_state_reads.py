"""Reads of the hidden-state files another process wrote are bounded (docs/security.md "Bounded reads"): the
operator's report reads every state marker of a tenant's run, and an export reads each state file."""

from __future__ import annotations

import orjson
import pytest

from tokenmill_runner.store.bounded_get import ObjectTooLarge
from tokenmill_runner.store.hidden_states import STATE_MARKER_BYTES, read_state_bytes, state_markers
from tokenmill_runner.store.storage import LocalStorage, StorageError

MARKER = {"sample_id": "s1", "sample_index": 0, "file": "hidden_states/k.safetensors", "bytes": 16,
          "sha256": "0" * 64, "tokens": 1, "dtype": "bfloat16"}


def test_a_state_marker_over_its_cap_or_not_a_marker_is_refused_by_name(tmp_path):
    storage = LocalStorage(tmp_path)
    storage.put("d/hidden_commits/a.json", orjson.dumps(MARKER))
    assert [m["sample_id"] for m in state_markers(storage, "d")] == ["s1"]
    storage.put("d/hidden_commits/b.json", b"{" + b" " * STATE_MARKER_BYTES + b"}")
    with pytest.raises(ObjectTooLarge, match="hidden_commits/b.json"):
        list(state_markers(storage, "d"))
    storage.put("d/hidden_commits/b.json", b"[1, 2]")
    with pytest.raises(StorageError, match=r"hidden_commits/b.json: a state marker without"):
        list(state_markers(storage, "d"))
    storage.put("d/hidden_commits/b.json", b"\xff")
    with pytest.raises(StorageError, match=r"hidden_commits/b.json: not a state marker"):
        list(state_markers(storage, "d"))


def test_a_state_file_larger_than_its_marker_says_is_not_read_past_that(tmp_path):
    storage = LocalStorage(tmp_path)
    storage.put("d/hidden_states/k.safetensors", b"x" * (1 << 20))
    with pytest.raises(ObjectTooLarge, match="k.safetensors is over the 16 bytes"):
        read_state_bytes(storage, "d", MARKER)
