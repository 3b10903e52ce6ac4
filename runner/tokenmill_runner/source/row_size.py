"""The size bound on one prompt row, checked before a row is parsed, rendered or tokenized. Pure.

Tokenizing costs memory in proportion to the prompt: a fast tokenizer keeps ids, offsets and token strings for
every token (about 350 bytes each: a 20 MB line peaked at 3.7 GB before it was found too long). So a row is refused
by its size before any of that happens, with a bound no prompt that fits the context can reach: a token of a
common vocabulary covers a few bytes of text on average (English ~4, code ~3, CJK 1.5-3), and even JSON's
`\\uXXXX` escapes (6 bytes for one character) or long runs of spaces do not average 16 bytes per token over a whole
prompt. A row over `ROW_BYTES_PER_TOKEN` bytes per token of the context cannot fit and is recorded as
`prompt_too_long` unread (docs/input.md, docs/security.md). Rows under the bound but over `LARGE_PROMPT_CHARS` are
tokenized alone, so a batch never multiplies a large row's cost.

The bound is also capped in absolute bytes (`MAX_ROW_BYTES`): at 16 bytes per token a 4M-token context would allow
a 64 MiB row, and tokenizing real text costs about 220 bytes of memory per byte of row (a 7.5 MB row peaked at
1.6 GB), so a long context would let one row take the runner past its pod's 8Gi limit. 16 MiB of text is about
4M tokens of English, more than any context a prompt must fill: no prompt that fits is refused by the cap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .prompts import Prompt, RowError

ROW_BYTES_PER_TOKEN = 16
# When neither the spec nor the model's config.json names a context length before the servers answer.
FALLBACK_CONTEXT_TOKENS = 262144
LARGE_PROMPT_CHARS = 64 * 1024
# ~3.7 GB tokenizing at the measured 220 bytes of memory per byte of row, well under the runner pod's 8Gi limit
# (manifests.runner_job) with the rest of the worker beside it.
MAX_ROW_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class RowBound:
    context_length: int  # tokens; an upper bound of the server's is enough (the bound only refuses certain misfits)

    @classmethod
    def of(cls, *context_lengths: int | None) -> RowBound:
        """The bound for the first known context length (spec, then config.json), else the fallback."""
        known = next((value for value in context_lengths if isinstance(value, int) and value > 0), None)
        return cls(known or FALLBACK_CONTEXT_TOKENS)

    @property
    def max_bytes(self) -> int:
        return min(self.context_length * ROW_BYTES_PER_TOKEN, MAX_ROW_BYTES)

    def refusal(self, line: int, size: int, sample_id: str | None = None, unit: str = "bytes") -> RowError:
        who = f"line {line}" if sample_id is None else f"line {line} (sample {sample_id})"
        if self.max_bytes < self.context_length * ROW_BYTES_PER_TOKEN:
            return RowError(line, sample_id, "prompt_too_long",
                            f"{who}: the row is {size} {unit}, over the {MAX_ROW_BYTES} {unit} any row may take "
                            f"whatever the context (the runner's memory bound; {self.context_length}-token context); "
                            "it was refused before tokenizing. Shorten or split the prompt")
        return RowError(line, sample_id, "prompt_too_long",
                        f"{who}: the row is {size} {unit}, over the {self.max_bytes} {unit} that any prompt of a "
                        f"{self.context_length}-token context can take ({ROW_BYTES_PER_TOKEN} per token); it was "
                        "refused before tokenizing. Shorten or split the prompt, or raise spec.server.contextLength")


def text_size(value: Any) -> int:
    """Characters of every string in a parsed row's value (keys included): what rendering has to copy."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(str(key)) + text_size(item) for key, item in value.items())
    if isinstance(value, list):
        return sum(text_size(item) for item in value)
    return 8 if value is not None else 0


def prompt_size(prompt: Prompt) -> int:
    """The prompt's characters (`text_size` of its messages and tools), measured once: the reader's bound, the
    stream's chunking and its tokenizer batches all ask."""
    size = prompt.__dict__.get("_size")
    if size is None:
        size = text_size(prompt.messages) + text_size(prompt.tools)
        object.__setattr__(prompt, "_size", size)  # a frozen dataclass: set once, never changed
    return int(size)
