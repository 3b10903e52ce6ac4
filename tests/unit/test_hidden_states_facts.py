"""SGLang 0.5.23's aux hidden-state facts (runner/tokenmill_runner/facts/hidden_states.py) and their arithmetic."""

from __future__ import annotations

import pytest

from tokenmill_runner.facts.hidden_states import (
    StateShape,
    capture_max_new_tokens,
    capture_request,
    check_layer_ids,
    default_eagle3_layer_ids,
)
from tokenmill_runner.facts.releases import RELEASES


def test_only_0_5_23_captures_aux_hidden_states():
    # 0.5.22 has --enable-return-hidden-states and --return-hidden-states-mode only (0.5.22
    # arg_groups/fields/exec_.py:110-120); 0.5.23 adds --enable-return-aux-hidden-states (exec_.py:130).
    assert [v for v, r in RELEASES.items() if r.aux_hidden_states] == ["0.5.23"]


def test_the_default_equals_the_inputs_of_layers_2_half_and_minus_3():
    # models/llama.py:933-941: default layers_to_capture [2, L//2, L-3]; an explicit id i captures layer i + 1's input.
    for layers in (8, 32, 61, 94):
        assert [i + 1 for i in default_eagle3_layer_ids(layers)] == [2, layers // 2, layers - 3]
    with pytest.raises(ValueError, match="at least 4"):
        default_eagle3_layer_ids(3)


def test_layer_ids_are_checked_as_sglang_checks_them():
    # spec_aux_hidden_state.py:113-129 and validation_hook.py:733-745.
    check_layer_ids([0, 5, 7], 8)
    for ids, message in (([], "empty"), ([-1], "non-negative"), ([2, 2], "repeat"), ([8], "out of range")):
        with pytest.raises(ValueError, match=message):
            check_layer_ids(ids, 8)


def test_state_bytes_are_tokens_times_layers_times_hidden_times_dtype():
    shape = StateShape(3, 1024, "bfloat16")
    assert shape.state_bytes(2048) == 2048 * 3 * 1024 * 2
    assert StateShape(3, 7168, "float32").bytes_per_token == 3 * 7168 * 4


def test_a_capture_request_keeps_every_prefill_chunk_and_no_cached_prefix():
    body = capture_request(list(range(100)), "r", chunked_prefill_tokens=32)
    # 100 tokens in chunks of 32: 4 chunks, one more when the batch's budget splits once more.
    assert body["sampling_params"]["max_new_tokens"] == capture_max_new_tokens(100, 32) == 5
    assert body["sampling_params"]["ignore_eos"] is True
    assert (body["return_logprob"], body["logprob_start_len"], body["return_hidden_states"]) == (True, 0, True)
