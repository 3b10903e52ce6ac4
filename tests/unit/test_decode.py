"""`inspect` decodes a sample back into the parts that were put in."""

from __future__ import annotations

import json

from tokenmill_runner.render.pretokenize import PromptEncoder
from tokenmill_runner.report.decode import output_parts, prompt_parts, render_sample
from tokenmill_runner.source.prompts import Prompt

TOOLS = [{"type": "function", "function": {"name": "convert_currency", "description": "Convert an amount",
                                           "parameters": {"type": "object", "properties": {"amount": {"type": "number"}}}}}]
SYSTEM = "You are a travel assistant."
USER = "How much is 120 euros in yen?"
REASONING = "The user wants a conversion. I should call convert_currency with the amount."
ANSWER = "Let me convert that for you."
CALL = 'functions.convert_currency:0<|tool_call_argument_begin|>{"amount": 120}<|tool_call_end|>'


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def fixture_row(tokenizer, finish: str = "stop") -> dict:
    prompt = Prompt(1, "fx-1", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}], TOOLS)
    [prompt_ids] = PromptEncoder(tokenizer).encode_batch([prompt])
    end = tokenizer.convert_tokens_to_ids("</think>")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    section = ids(tokenizer, "<|tool_calls_section_begin|><|tool_call_begin|>" + CALL + "<|tool_calls_section_end|>")
    output = ids(tokenizer, REASONING) + [end] + ids(tokenizer, ANSWER) + section + [eos]
    return {"dataset": "B1", "sample_id": "fx-1", "line": 1, "prompt_ids": prompt_ids, "output_ids": output,
            "prompt_tokens": len(prompt_ids), "completion_tokens": len(output), "finish_reason": finish,
            "matched_stop": eos, "reasoning_end": output.index(end), "has_tool_call": True, "max_new_tokens": 2048,
            "latency_s": 1.25}


def texts(tokenizer, parts) -> dict[str, str]:
    return {p.name: tokenizer.decode(p.ids, skip_special_tokens=False) for p in parts}


def test_prompt_parts_round_trip(tokenizer):
    row = fixture_row(tokenizer)
    eos = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    parts = prompt_parts(tokenizer, row["prompt_ids"], eos)
    assert [p.name for p in parts] == ["tools", "system", "user", "generation prompt"]
    decoded = texts(tokenizer, parts)
    assert decoded["system"] == SYSTEM and decoded["user"] == USER
    assert json.loads(decoded["tools"]) == TOOLS
    assert decoded["generation prompt"].endswith("<think>")


def test_output_parts_round_trip(tokenizer):
    row = fixture_row(tokenizer)
    parts = output_parts(row, tokenizer.convert_tokens_to_ids("<|tool_calls_section_begin|>"))
    assert [p.name for p in parts] == ["reasoning", "end of reasoning", "answer", "tool calls", "stop token"]
    decoded = texts(tokenizer, parts)
    assert decoded["reasoning"] == REASONING and decoded["answer"] == ANSWER
    assert decoded["end of reasoning"] == "</think>" and decoded["stop token"] == "<|im_end|>"
    assert CALL in decoded["tool calls"]
    assert [t for p in parts for t in p.ids] == row["output_ids"], "the parts cover the output exactly"
    assert parts[1].start == row["reasoning_end"]


def test_truncated_while_reasoning(tokenizer):
    reasoning = ids(tokenizer, REASONING * 3)
    row = {"output_ids": reasoning, "finish_reason": "length", "matched_stop": None, "reasoning_end": None}
    [part] = output_parts(row, None)
    assert part.name == "reasoning (truncated, no end token)" and part.ids == reasoning


def test_terminal_view_elides_long_parts(tokenizer):
    row = fixture_row(tokenizer)
    long_reasoning = ids(tokenizer, REASONING * 40)
    row["output_ids"] = long_reasoning + row["output_ids"][row["reasoning_end"]:]
    row["reasoning_end"] = len(long_reasoning)
    eos = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    tool = tokenizer.convert_tokens_to_ids("<|tool_calls_section_begin|>")
    text = render_sample(tokenizer, row, prompt_parts(tokenizer, row["prompt_ids"], eos), output_parts(row, tool),
                         keep=30)
    assert "══ B1 · sample fx-1 (line 1) ══" in text
    assert f"reasoning · {len(long_reasoning)} tokens" in text
    assert f"[{len(long_reasoning) - 60} tokens hidden]" in text
    assert "finish: stop (<|im_end|>)" in text and USER in text


def test_reasoning_ended_by_the_tool_call_section_keeps_the_opener_with_the_calls() -> None:
    from tokenmill_runner.report.decode import output_parts

    section, think, eos = 9, 15, 4
    row = {"output_ids": [100, 101, section, 200, 201, eos], "finish_reason": "stop", "matched_stop": eos,
           "reasoning_end": 2, "reasoning_end_token_id": section}
    parts = output_parts(row, section)
    assert [(p.name, p.ids) for p in parts] == [("reasoning (ended by a tool call)", [100, 101]),
                                                ("tool calls", [section, 200, 201]), ("stop token", [eos])]
    row = {**row, "output_ids": [100, think, section, 200, eos], "reasoning_end": 1, "reasoning_end_token_id": think}
    assert [p.name for p in output_parts(row, section)] == ["reasoning", "end of reasoning", "tool calls", "stop token"]
