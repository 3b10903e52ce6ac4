"""Generation units: what every export is built from. Pure.

A *generation unit* is one answer the target generated: the prompt ids it was given, the output ids it produced,
and the facts recorded with them (finish reason, where reasoning ended, ...). A committed row today holds one unit.
A multi-turn row (one conversation regenerated turn by turn) holds one unit per assistant turn in a `turns` column:
a list of dicts with at least `prompt_ids` and `output_ids`; any other key of a turn (finish_reason,
reasoning_end, ...) overrides the row's value for that turn. `sample_index` (n samples per prompt) is read from
the row when the column exists, 0 otherwise.

The slot of a unit is (dataset, source line, sample index): exactly one committed outcome per slot, so an export
that meets a slot twice (two markers naming it) keeps the first and counts the second (`SlotSeen`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

UNIT_FIELDS = ("finish_reason", "matched_stop", "reasoning_end", "reasoning_end_token_id", "has_tool_call",
               "max_new_tokens")


@dataclass(frozen=True)
class GenerationUnit:
    dataset: str
    sample_id: str
    line: int
    sample_index: int
    turn_index: int
    turns: int  # assistant turns in the unit's conversation (1 for a single-turn row)
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str | None
    matched_stop: int | None
    reasoning_end: int | None  # index in output_ids of the token that ended reasoning, or None
    reasoning_end_token_id: int | None
    has_tool_call: bool
    max_new_tokens: int | None
    # Whether this turn's prompt ids extend the previous turn's prompt + output ids token for token (a template that
    # drops reasoning from history answers makes it False); True for a first turn and a single-turn row.
    history_exact: bool = True
    # A whole conversation as one unit (--per-conversation): the spans of input_ids the model generated, one per
    # turn (the last turn's output among them); None for a unit of one generation.
    spans: tuple[tuple[int, int], ...] | None = None
    # A turn of a conversation regenerated turn by turn (mode all-turns): its prompt is the regenerated history,
    # not the source row's messages.
    in_conversation: bool = False

    @property
    def id(self) -> str:
        # Sample ids are unique per dataset only (id-less rows are "L<line>" in every dataset), so the dataset is
        # part of the id; `#s`/`#t` name the sample and the turn (the researcher's rule 9 in the trainers' notes).
        if self.spans is not None:
            return self.conversation_id
        return f"{self.dataset}/{self.sample_id}#s{self.sample_index}#t{self.turn_index}"

    @property
    def conversation_id(self) -> str:
        return f"{self.dataset}/{self.sample_id}#s{self.sample_index}"

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def has_reasoning(self) -> bool:
        return self.reasoning_end is not None

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def loss_mask(self) -> list[int]:
        # 1 on exactly what the target generated, the stop token included (both trainers supervise it).
        if self.spans is None:
            return [0] * len(self.prompt_ids) + [1] * len(self.output_ids)
        mask = [0] * (len(self.prompt_ids) + len(self.output_ids))
        for begin, end in self.spans:
            mask[begin:end] = [1] * (end - begin)
        return mask

    @property
    def supervised_tokens(self) -> int:
        return len(self.output_ids) if self.spans is None else sum(end - begin for begin, end in self.spans)


def _unit(row: dict[str, Any], turn: dict[str, Any], turn_index: int, turns: int) -> GenerationUnit:
    merged = {**row, **turn}
    return GenerationUnit(
        dataset=row["dataset"], sample_id=row["sample_id"], line=int(row["line"]),
        sample_index=int(row.get("sample_index") or 0), turn_index=turn_index, turns=turns,
        prompt_ids=[int(i) for i in merged["prompt_ids"]], output_ids=[int(i) for i in merged["output_ids"]],
        **{name: merged.get(name) for name in UNIT_FIELDS if name != "has_tool_call"},
        has_tool_call=bool(merged.get("has_tool_call")),
        history_exact=merged.get("history_exact") is not False, in_conversation=bool(turn),
    )


def conversation_unit(row: dict[str, Any]) -> GenerationUnit | None:
    """A conversation as one unit: its last turn's prompt + output ids, supervised on every turn's output. Only
    when each turn's prompt extends the previous turn's prompt + output ids token for token (`history_exact`),
    so every answer sits in the last sequence exactly as generated; None otherwise (templates that drop history
    reasoning, Kimi's and the demo's among them: export those per turn)."""
    turns = row.get("turns")
    if not turns or any(turn.get("history_exact") is not True for turn in turns[1:]):
        return None
    spans = tuple((len(turn["prompt_ids"]), len(turn["prompt_ids"]) + len(turn["output_ids"])) for turn in turns)
    last = _unit(row, turns[-1], len(turns) - 1, len(turns))
    return replace(last, spans=spans, has_tool_call=any(bool(turn.get("has_tool_call")) for turn in turns))


def units_from_row(row: dict[str, Any], per_conversation: bool = False) -> Iterator[GenerationUnit]:
    """One unit per assistant turn of a committed row (one for single-turn rows); with `per_conversation`, one
    per conversation where `conversation_unit` can build it, per turn otherwise."""
    turns = row.get("turns")
    if not turns:
        yield _unit(row, {}, 0, 1)
        return
    whole = conversation_unit(row) if per_conversation else None
    if whole is not None:
        yield whole
        return
    for index, turn in enumerate(turns):
        yield _unit(row, turn, index, len(turns))


class SlotSeen:
    """Which (line, sample index) slots of one dataset were already exported: one byte per line and sample index
    (numpy, grown as lines appear), never a Python object per sample."""

    def __init__(self) -> None:
        self._seen: dict[int, np.ndarray] = {}

    def add(self, line: int, sample_index: int = 0) -> bool:
        """Mark the slot; False when it was already marked."""
        seen = self._seen.get(sample_index)
        if seen is None or line >= len(seen):
            grown = np.zeros(max(line + 1, 2 * (len(seen) if seen is not None else 1024)), dtype=np.bool_)
            if seen is not None:
                grown[:len(seen)] = seen
            self._seen[sample_index] = seen = grown
        if seen[line]:
            return False
        seen[line] = True
        return True


def invalid_reason(unit: GenerationUnit, vocab_size: int | None) -> str | None:
    """Why no trainer should get this unit (reasons in manifest.INVALID_REASONS), or None."""
    if not unit.output_ids:
        return "no_output_tokens"
    if vocab_size is not None and (max(unit.input_ids) >= vocab_size or min(unit.input_ids) < 0):
        return "id_out_of_vocab"
    return None
