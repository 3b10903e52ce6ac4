"""The runner's per-shard row pass gives exactly the rows the per-answer scans gave, and the answer check classifies as
before (issue 44: the checks moved off the per-answer path)."""

from __future__ import annotations

import random
from array import array
from typing import Any

import numpy as np
import pytest

from tokenmill_runner.generate.results import AttemptFailed, Generation, parse_generation
from tokenmill_runner.generate.rows import ANSWER_FIELDS, finish_rows, pending_row
from tokenmill_runner.render.tokenizer_info import TokenizerInfo
from tokenmill_runner.source.prompts import Prompt


def info(end_ids: list[int], tool: int | None) -> TokenizerInfo:
    return TokenizerInfo(location="x", vocab_size=1000, eos_token_ids=[2], eos_tokens={"2": "</s>"},
                         reasoning_end_token="</think>" if end_ids else None,
                         reasoning_end_id=end_ids[0] if end_ids else None,
                         reasoning_end_tokens={str(i): f"t{i}" for i in end_ids}, tool_call_token=None,
                         tool_call_id=tool, model_context_length=None)


def generation(output: list[int], reasoning: int | None, packed: bool) -> Generation:
    return Generation(output_ids=output, prompt_tokens=3, completion_tokens=len(output), finish_reason="stop",
                      matched_stop=None, latency_s=0.123456, attempts=1, server="s", reasoning_tokens=reasoning,
                      packed_ids=array("i", output) if packed else None)


def _scalar_row(row: dict[str, Any], output: list[int], server_count: int | None,
                tokenizer: TokenizerInfo) -> dict[str, Any]:
    """The answer fields as the runner read them one answer at a time before (rows.py at 7dcc205): list scans."""
    ends = [int(i) for i in tokenizer.reasoning_end_tokens] or (
        [] if tokenizer.reasoning_end_id is None else [tokenizer.reasoning_end_id])
    at = min((output.index(token), token) for token in ends if token in output) if set(ends) & set(output) else None
    if not server_count:
        agrees = None
    else:
        counted = tokenizer.reasoning_end_id
        agrees = (output.index(counted) + 1 if counted in output else len(output)) == server_count
    return {**row, "reasoning_end": None if at is None else at[0], "reasoning_end_token_id": None if at is None else at[1],
            "has_tool_call": tokenizer.tool_call_id is not None and tokenizer.tool_call_id in output,
            "reasoning_agrees": agrees, "reasoning_disagreements": int(agrees is False)}


@pytest.mark.parametrize("end_ids,tool", [([], None), ([7], None), ([7, 9], 11), ([9, 7], 7), ([], 11)])
def test_a_shard_of_pending_rows_finishes_as_the_per_answer_scans_read_them(end_ids: list[int], tool: int | None) -> None:
    rng = random.Random(len(end_ids) * 31 + (tool or 0))
    tokenizer = info(end_ids, tool)
    rows, expected = [], []
    for number in range(300):
        output = [rng.choice([7, 9, 11, 5, 6, 8]) if rng.random() < 0.05 else rng.randrange(0, 1000)
                  for _ in range(rng.choice([0, 0, 1, 3, 40]))]
        reasoning = rng.choice([None, 0, len(output), *(range(1, len(output) + 1))])
        made = generation(output, reasoning, packed=number % 2 == 0)
        prompt = Prompt(line=number, sample_id=f"s{number}", messages=[], tools=None)
        rows.append(pending_row("d", prompt, [1, 2, 3], made, 64, number % 3, number))
        expected.append(_scalar_row(pending_row("d", prompt, [1, 2, 3], made, 64, number % 3, number), output,
                                    reasoning, tokenizer))
        assert not set(ANSWER_FIELDS) & set(rows[-1])
    finish_rows(rows, tokenizer)
    for row, want in zip(rows, expected, strict=True):
        assert row.keys() == want.keys()
        for key, value in want.items():
            got = row[key]
            assert (list(got) if key == "output_ids" else got) == (list(value) if key == "output_ids" else value)
            assert type(got) is type(value), key
    before = [dict(row) for row in rows]
    finish_rows(rows, tokenizer)  # finished rows are left alone (a commit retried)
    assert rows == before


def _old_check(output_ids: Any, vocab_size: int | None) -> str:
    """How the answer's ids were checked before (results.py at 7dcc205): the classification and message."""
    packed = None
    try:
        packed = array("i", output_ids) if isinstance(output_ids, list) else None
    except OverflowError:
        packed = None
    except TypeError:
        return "bad_response"
    if packed is None and not (isinstance(output_ids, list) and all(type(token) is int for token in output_ids)):
        return "bad_response"
    checked = np.frombuffer(packed, dtype=np.int32) if packed is not None else np.array(output_ids, dtype=object)
    if packed is None and vocab_size is None:
        vocab_size = 1 << 31
    if vocab_size is not None and checked.size and (int(checked.max()) >= vocab_size or int(checked.min()) < 0):
        bad = next(t for t in output_ids if not 0 <= t < vocab_size)
        return f"nan_output {bad} {vocab_size}"
    return "ok"


@pytest.mark.parametrize("output", [[], [1, 2, 3], [0, 999], [1000], [-1, 5], [True, 3], [1.5], ["a"], [1, None],
                                    [1 << 31], [(1 << 31) - 1], [-(1 << 31)], [-(1 << 31) - 1], [1 << 40, -3],
                                    [-3, 1 << 40], [1 << 70], [1 << 70, "a"], [1 << 40, "a"], ["a", 1 << 70], "abc",
                                    {"a": 1}, [[1]]])
@pytest.mark.parametrize("vocab", [None, 1000])
def test_the_answer_check_classifies_ids_as_before(output: Any, vocab: int | None) -> None:
    body = {"output_ids": output, "meta_info": {"finish_reason": {"type": "stop"},
                                                "completion_tokens": len(output)}}
    result = parse_generation(body, "s", 1, vocab)
    old = _old_check(output, vocab)
    if isinstance(result, Generation):
        assert old == "ok"
        assert result.packed_ids is not None and result.packed_ids.typecode == "i"
        assert list(result.packed_ids) == list(output)
    else:
        assert isinstance(result, AttemptFailed)
        if old.startswith("nan_output"):
            _, bad, size = old.split()
            assert result.reason == "nan_output" and f"output id {bad} " in result.message and f"({size} ids)" in \
                result.message
        else:
            assert result.reason == old, result
