"""Reads of the hidden-state files another process wrote are bounded (docs/security.md "Bounded reads"): the
operator's report reads every state marker of a tenant's run, and an export reads each state file."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import numpy as np
import orjson
import pytest

from tokenmill_runner.facts.hidden_states import StateShape
from tokenmill_runner.store.bounded_get import ObjectTooLarge
from tokenmill_runner.store.hidden_states import (
    FINAL,
    STATE_MARKER_BYTES,
    captured_keys,
    commit_states,
    read_state_bytes,
    sample_key,
    state_markers,
)
from tokenmill_runner.store.ownership import Fence
from tokenmill_runner.store.storage import TMP_MARK, LocalStorage, StorageError

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


# A writer SIGKILLed inside the local store's atomic write of a marker: the whole marker is in its temporary file
# beside the marker's name, the rename never happens. The capture commits markers from parallel threads, so a kill
# at one sample's commit (TOKENMILL_FAULT) can land here for another's: what made
# test_specforge_offline's kill-before:final-marker:3 see two markers of one sample, under load.
_KILLED_AT_THE_RENAME = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from tokenmill_runner.facts.hidden_states import StateShape
    from tokenmill_runner.store.hidden_states import FINAL, commit_states
    from tokenmill_runner.store.ownership import Fence
    from tokenmill_runner.store.storage import LocalStorage
    replace = os.replace
    def killed_at_a_marker(src, dst):
        if str(dst).endswith(".json"):
            os.kill(os.getpid(), signal.SIGKILL)
        replace(src, dst)
    os.replace = killed_at_a_marker
    commit_states(LocalStorage(sys.argv[1]), "d", "s0001", 0, [1, 2], np.zeros(2 * 4), StateShape(1, 4, "bfloat16"),
                  Fence.unleased("killed0000000000"), kind=FINAL)
""")


def test_a_marker_write_killed_before_its_rename_counts_for_nothing_and_the_resume_leaves_one(tmp_path):
    killed = subprocess.run([sys.executable, "-c", _KILLED_AT_THE_RENAME, str(tmp_path)], capture_output=True,
                            text=True, timeout=60)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    key = sample_key("s0001", 0)
    left = list((tmp_path / "d" / FINAL.commits).iterdir())
    assert [p.name.split(TMP_MARK)[0] for p in left] == [f"{key}-killed0000000000.json"], \
        "the kill left the marker's temporary file"
    assert orjson.loads(left[0].read_bytes())["sample_id"] == "s0001"
    storage = LocalStorage(tmp_path)
    # Not committed: the sample is still to capture, and no reader counts it.
    assert captured_keys(storage, "d", FINAL) == set()
    assert list(state_markers(storage, "d", FINAL)) == []
    commit_states(storage, "d", "s0001", 0, [1, 2], np.zeros(2 * 4), StateShape(1, 4, "bfloat16"),
                  Fence.unleased("resumed000000000"), kind=FINAL)
    assert captured_keys(storage, "d", FINAL) == {key}
    assert [m["sample_id"] for m in state_markers(storage, "d", FINAL)] == ["s0001"]
