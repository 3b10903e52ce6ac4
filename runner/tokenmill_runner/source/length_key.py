"""A row's length key: how long its new answer is expected to be, as the counting pass records it per line. Pure.

A source row usually carries an earlier answer, the assistant turn(s) being regenerated: their length predicts the
new one (the same task, the same kind of answer). Without one, the prompt's length stands in: a coarse class, since
a long prompt (a document, a code base) asks for a longer answer more often than a short one.

The counting pass reads every row once before any request, so it records each line's key as one byte (a *code*,
`length_code`), and the stream orders the whole job by the codes (`generate/ordering.py`) without holding a thing
per line: the codes are read back in line order, as the source is.
"""

from __future__ import annotations

import math
from typing import Any

# The answer's characters per token, only to put answers and prompts on one scale: the order needs a monotone
# estimate, not an exact count.
CHARS_PER_TOKEN = 4.0
# Prompt length classes (tokens) for rows without an earlier answer: 0 under 256, 1 under 1,024, 2 under 4,096, 3.
PROMPT_CLASSES = (256, 1024, 4096)
# Earlier answers in quarter doublings of tokens: sorting the whole job by codes this fine keeps 96 % of what an
# exact sort gains (doublings: 60 %, hack/bench/bench_ordering.py at rho 0.8); a byte holds them all.
STEPS_PER_DOUBLING = 4
ANSWER_CODES = 5  # code of the shortest answers (under ~9.5 tokens); each next code is 2^(1/4) longer
CODES = ANSWER_CODES + 11 * STEPS_PER_DOUBLING  # 0: no key; 1-4: prompt classes 0-3; 5-48: earlier answers


def _text_length(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # multi-part content: the text parts
        return sum(len(part.get("text") or "") for part in content if isinstance(part, dict))
    return 0


def earlier_answer_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of the row's assistant turns: content, reasoning and tool-call arguments."""
    total = 0
    for message in messages:
        if message.get("role") != "assistant":
            continue
        total += _text_length(message.get("content")) + _text_length(message.get("reasoning_content"))
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                total += len(str(function.get("arguments") or ""))
    return total


def prompt_class(prompt_tokens: float) -> int:
    return sum(prompt_tokens >= bound for bound in PROMPT_CLASSES)


def length_code(messages: list[dict[str, Any]], prompt_chars: int) -> int:
    """The line's code: its earlier answer's length in quarter doublings of tokens (5-48), else its prompt's class
    (1-4)."""
    chars = earlier_answer_chars(messages)
    if chars:
        return answer_code(chars / CHARS_PER_TOKEN)
    return 1 + prompt_class(prompt_chars / CHARS_PER_TOKEN)


def answer_code(tokens: float) -> int:
    """The code of an earlier answer of `tokens` tokens: 5 under 2^3.25 tokens, one more per quarter doubling, the
    last from 2^13.75 (~13,800) on."""
    steps = int(math.log2(max(tokens, 1.0)) * STEPS_PER_DOUBLING) - 3 * STEPS_PER_DOUBLING
    return ANSWER_CODES + max(0, min(CODES - 1 - ANSWER_CODES, steps))


def answer_tokens(code: int) -> float | None:
    """The earlier answer's length a code stands for (the middle of its step, in tokens); None for a prompt class
    or no key."""
    if code < ANSWER_CODES:
        return None
    return float(2.0 ** ((code - ANSWER_CODES + 0.5) / STEPS_PER_DOUBLING + 3))
