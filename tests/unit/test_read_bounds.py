"""Bounds a tenant's input meets before it is parsed: the row bound's absolute cap at long contexts, and YAML alias
expansion when a spec is loaded (docs/security.md "Bounded reads")."""

from __future__ import annotations

import pytest

from tokenmill_runner.source.reader import read_prompts
from tokenmill_runner.source.row_size import MAX_ROW_BYTES, RowBound
from tokenmill_runner.spec.resource import MAX_SPEC_NODES, SpecError, load_yaml_bounded


def test_a_long_context_cannot_raise_the_row_bound_past_the_runner_memory(tmp_path):
    # spec.server.contextLength 2^24: 16 bytes per token would allow a 256 MiB row, ~55 GB to tokenize.
    bound = RowBound(context_length=2**24)
    assert bound.max_bytes == MAX_ROW_BYTES == 16 * 1024 * 1024
    line = b'{"sample_id": "long", "messages": [{"role": "user", "content": "' + b"w" * (17 * 1024 * 1024) + b'"}]}'
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"sample_id": "ok", "messages": [{"role": "user", "content": "hi"}]}\n' + line + b"\n")
    ok, long = read_prompts(str(path), "jsonl", bound=bound)
    assert ok.sample_id == "ok" and long.reason == "prompt_too_long"
    assert long.message.startswith(f"line 2: the row is {len(line) + 1} bytes, over the {MAX_ROW_BYTES} bytes any row")  # with its \n
    # Short contexts keep their 16 bytes per token.
    assert RowBound(32768).max_bytes == 524288


def test_nested_yaml_anchors_are_refused_before_anything_is_built():
    levels = ['a0: &a0 "lol"'] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]
    with pytest.raises(SpecError, match=f"spec.yaml: its YAML aliases expand to over {MAX_SPEC_NODES} nodes"):
        load_yaml_bounded("\n".join(levels), "spec.yaml")
    with pytest.raises(SpecError, match="refers to itself"):
        load_yaml_bounded("a: &a [*a]", "spec.yaml")
    # A few shared anchors, as specs use them, load as before.
    assert load_yaml_bounded("base: &b {x: 1}\nd: [*b, *b]", "s") == {"base": {"x": 1}, "d": [{"x": 1}, {"x": 1}]}
