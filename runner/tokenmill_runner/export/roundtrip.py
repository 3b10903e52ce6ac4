"""Does a text export give the trainer back the ids the target generated? Pure: the tokenizer is passed in.

A text record is only as good as what the trainer rebuilds from it. For each unit this module builds the text
record (pre-formatted text, or a conversation with `reasoning_content`), rebuilds the ids the way SpecForge would
(re-tokenize the text; or prepare the conversation, render it with the model's chat template and tokenize), and
compares them with the stored prompt + output ids; where the ids agree, it builds SpecForge's loss mask for the
chosen template (`specforge_rules.loss_mask`) and compares it with the target's (1 on exactly the generated tokens).
A difference is a `Mismatch`: a stable reason and the first differing position, so the export can report it
instead of writing a record that teaches the drafter tokens the target never produced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from ..source.prompts import Prompt
from .formats import conversation_record, text_record
from .specforge_rules import MaskDifference, SpecForgeTemplate, loss_mask, mask_difference, prepare
from .units import GenerationUnit

# Stable reason codes, counted in export.json and written to mismatches.jsonl.
MISMATCH_REASONS: dict[str, str] = {
    "retokenization": "decoding the ids and tokenizing the text gives other ids (the tokenizer does not round-trip "
                      "this text)",
    "reasoning_dropped": "the chat template or the trainer renders this answer without its reasoning",
    "prompt_rerender": "the chat template renders the prompt differently once the answer follows it",
    "output_rerender": "the chat template renders the answer differently from what was generated",
    "trainer_system_prompt": "SpecForge inserts its template's system prompt before a conversation without one; "
                             "the target saw no such prompt",
    "truncated_turn": "the answer was cut at maxNewTokens: a rendered conversation closes every assistant turn, so "
                      "the trainer would learn an end of turn the target never produced",
    "template_error": "the chat template failed on the conversation",
    "trainer_loss_mask": "SpecForge's loss mask for the chosen template (from its assistant header to its end-of-turn "
                         "token, data.train_only_last_turn: true) trains on tokens the target did not generate here "
                         "(a generation prompt's <think>, a template's suffix such as Qwen's \"\\n\" after "
                         "<|im_end|>) or skips generated ones",
    "source_changed": "the source line no longer holds this sample (the prompt file changed after the run)",
}
CONTEXT = 8  # ids shown on each side of the first difference


class Tokenizer(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...
    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any: ...
    def __call__(self, text: str, add_special_tokens: bool = ...) -> Any: ...


@dataclass(frozen=True)
class Mismatch:
    reason: str
    position: int  # first index of input_ids (prompt + output) where the trainer's ids differ
    expected: list[int]  # the stored ids around `position`
    got: list[int]  # the trainer's ids around `position`
    detail: str = ""

    def record(self, unit: GenerationUnit) -> dict[str, Any]:
        return {"id": unit.id, "dataset": unit.dataset, "sample_id": unit.sample_id, "line": unit.line,
                "sample_index": unit.sample_index, "turn_index": unit.turn_index, "reason": self.reason,
                "position": self.position, "prompt_tokens": len(unit.prompt_ids),
                "output_position": self.position - len(unit.prompt_ids) if self.position >= len(unit.prompt_ids)
                else None, "expected": self.expected, "got": self.got, "detail": self.detail}


@dataclass(frozen=True)
class Checked:
    record: dict[str, Any]  # what the export writes for the unit (when it matches, or with --keep-mismatched)
    mismatch: Mismatch | None
    suffix_tokens: int = 0  # tokens the template renders after the generated ids (e.g. Qwen's "\n" after <|im_end|>)
    mask: MaskDifference | None = None  # where SpecForge's loss mask differs from the target's, when it does


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    # What SpecForge does with a rendered conversation or a pre-formatted text (SF data/parse.py:272-279).
    encoded = tokenizer(text, add_special_tokens=False)
    return [int(i) for i in encoded["input_ids"]]


def first_difference(expected: list[int], got: list[int]) -> int | None:
    """Index of the first differing id; len(expected) when `got` only adds ids after it; None when equal."""
    for index, (want, have) in enumerate(zip(expected, got, strict=False)):
        if want != have:
            return index
    if len(got) == len(expected):
        return None
    return min(len(expected), len(got))


def _mismatch(reason: str, position: int, expected: list[int], got: list[int],
              tokenizer: Tokenizer | None = None) -> Mismatch:
    window = slice(max(position - CONTEXT, 0), position + CONTEXT)
    detail = ""
    if tokenizer is not None:
        stored, trainer = (tokenizer.decode(ids[window], skip_special_tokens=False) for ids in (expected, got))
        detail = f"stored {stored!r}, trainer {trainer!r}"
    return Mismatch(reason, position, expected[window], got[window], detail)


def check_mask(tokenizer: Tokenizer, unit: GenerationUnit, text: str, trainer_ids: list[int],
               template: SpecForgeTemplate, record: dict[str, Any], suffix_tokens: int = 0) -> Checked:
    """SpecForge's loss mask over the text it renders (the ids already agree) against the target's."""
    trainer = loss_mask(lambda part: encode(tokenizer, part), text, template, tokens=len(trainer_ids))
    target = unit.loss_mask
    difference = mask_difference(target, trainer, len(unit.prompt_ids))
    if difference.first is None:
        return Checked(record, None, suffix_tokens)
    window = slice(max(difference.first - CONTEXT, 0), difference.first + CONTEXT)
    wanted = (target + [0] * len(trainer))[:len(trainer)]
    spans = [("prompt", [i for i in range(len(unit.prompt_ids)) if trainer[i]]),
             ("after the output", [i for i in range(len(target), len(trainer)) if trainer[i]]),
             ("generated, not trained", [i for i in range(len(unit.prompt_ids), len(target)) if not trainer[i]])]
    detail = "; ".join(f"{label}: {len(where)} token(s) {_text(tokenizer, [trainer_ids[i] for i in where[:16]])!r}"
                       for label, where in spans if where)
    mismatch = Mismatch("trainer_loss_mask", difference.first, wanted[window], trainer[window],
                        f"SpecForge {template.name}: {detail}")
    return Checked(record, mismatch, suffix_tokens, difference)


def _text(tokenizer: Tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def check_text(tokenizer: Tokenizer, unit: GenerationUnit, template: SpecForgeTemplate) -> Checked:
    """SpecForge's pre-formatted form: the decoded prompt + output, re-tokenized by the trainer, masked by its rule
    for the template."""
    ids = unit.input_ids
    text = tokenizer.decode(ids, skip_special_tokens=False)
    back = encode(tokenizer, text)
    record = text_record(unit, text)
    position = first_difference(ids, back)
    if position is None:
        return check_mask(tokenizer, unit, text, back, template, record)
    return Checked(record, _mismatch("retokenization", position, ids, back, tokenizer))


@dataclass(frozen=True)
class OutputSplit:
    reasoning: list[int] | None  # None: no end of reasoning in the output
    content: list[int]


def split_output(unit: GenerationUnit, openers: frozenset[int], tool_call_id: int | None) -> OutputSplit:
    """Reasoning and answer ids of an output, without the stop token (the template writes the end of turn)."""
    output = unit.output_ids
    stopped = unit.finish_reason == "stop" and unit.matched_stop is not None and output[-1:] == [unit.matched_stop]
    body = output[:-1] if stopped else output
    end = unit.reasoning_end
    if end is None:
        return OutputSplit(None, body)
    reasoning = body[:end]
    if reasoning[:1] and reasoning[0] in openers:  # the model opened reasoning itself (Qwen3-style outputs)
        reasoning = reasoning[1:]
    # Kimi-K2.5 may end reasoning by opening the tool-call section: that token belongs to the answer.
    content = body[end:] if unit.reasoning_end_token_id == tool_call_id and tool_call_id is not None else body[end + 1:]
    return OutputSplit(reasoning, content)


MESSAGE_KEYS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name")


def written_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as the conversations file holds it. Every message has the same keys: `datasets` reads the file
    into one struct type, so a key one message has reads as null in every other, and the check must render what
    the trainer will read. tool_calls is a JSON string, which SpecForge parses (SF data/parse.py:52-61), so
    `datasets` never merges different argument schemas into one struct."""
    role = message["role"]
    calls = message.get("tool_calls")
    return {
        "role": role,
        "content": message.get("content"),
        # "" rather than null for an assistant message without reasoning: templates that read it with a default
        # (Kimi's message.get('reasoning_content', '')) would print a null as "None".
        "reasoning_content": message.get("reasoning_content", "" if role == "assistant" else None),
        "tool_calls": orjson.dumps(calls).decode() if calls else None,
        "tool_call_id": message.get("tool_call_id"),
        "name": message.get("name"),
    }


SENTINEL = "tokenmill-system-sentinel-5c1f"


def _render(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            kwargs: dict[str, Any]) -> str:
    text: str = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                              tools=tools or None, **kwargs)
    return text


def default_system_prompt(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                          kwargs: dict[str, Any]) -> str | None:
    """The system prompt the model's template renders by itself for a conversation without one (Kimi's "You are
    Kimi, ..."), found by rendering once with a sentinel system message; None when it renders none."""
    try:
        without = _render(tokenizer, messages, tools, kwargs)
        with_sentinel = _render(tokenizer, [{"role": "system", "content": SENTINEL}, *messages], tools, kwargs)
    except Exception:  # noqa: BLE001 - a template that cannot render is reported by the check itself
        return None
    before, found, after = with_sentinel.partition(SENTINEL)
    fits = len(before) + len(after) <= len(without) and without.startswith(before) and without.endswith(after)
    if not found or not fits:
        return None
    text = without[len(before):len(without) - len(after)]
    explicit = _render(tokenizer, [{"role": "system", "content": text}, *messages], tools, kwargs)
    return text if explicit == without else None


@dataclass(frozen=True)
class ConversationContext:
    """What the conversation check needs besides the unit: the trainer's template and the run's facts."""

    template: SpecForgeTemplate
    template_kwargs: dict[str, Any]  # the run's chat template arguments, written as columns of every row
    openers: frozenset[int]  # ids that open reasoning (<think>), dropped from reasoning_content
    tool_call_id: int | None


def conversation(tokenizer: Tokenizer, prompt: Prompt, context: ConversationContext, reasoning_text: str | None,
                 content_text: str) -> list[dict[str, Any]]:
    answer: dict[str, Any] = {"role": "assistant", "content": content_text}
    if reasoning_text is not None:
        answer["reasoning_content"] = reasoning_text
    messages = [written_message(m) for m in prompt.messages] + [written_message(answer)]
    if messages[0]["role"] != "system" and context.template.system_prompt:
        # Write the model's own default system prompt out, so SpecForge does not insert its template's.
        default = default_system_prompt(tokenizer, [*prompt.messages, answer], prompt.tools, context.template_kwargs)
        if default is not None:
            messages.insert(0, written_message({"role": "system", "content": default}))
    return messages


def check_conversation(tokenizer: Tokenizer, unit: GenerationUnit, prompt: Prompt,
                       context: ConversationContext) -> Checked:
    """SpecForge's conversations form: the source messages plus the answer (reasoning in reasoning_content),
    prepared and rendered as SpecForge does, tokenized, compared with the stored ids."""
    ids = unit.input_ids
    split = split_output(unit, context.openers, context.tool_call_id)
    reasoning = None if split.reasoning is None else tokenizer.decode(split.reasoning, skip_special_tokens=False)
    content = tokenizer.decode(split.content, skip_special_tokens=False)
    messages = conversation(tokenizer, prompt, context, reasoning, content)
    record = conversation_record(unit, messages, prompt.tools, context.template_kwargs)
    if unit.truncated:
        return Checked(record, Mismatch("truncated_turn", len(ids), [], [],
                                        f"cut at {len(unit.output_ids)} tokens (maxNewTokens {unit.max_new_tokens})"))
    prepared = prepare(messages, context.template, context.template_kwargs)
    try:
        rendered = _render(tokenizer, prepared.messages, prompt.tools, prepared.template_kwargs)
    except Exception as error:  # noqa: BLE001 - jinja raises TemplateError, TypeError, KeyError...
        return Checked(record, Mismatch("template_error", 0, [], [], f"{type(error).__name__}: {error}"))
    got = encode(tokenizer, rendered)
    position = first_difference(ids, got)
    if position is None or (position == len(ids) and len(got) > len(ids)):
        return check_mask(tokenizer, unit, rendered, got, context.template, record, len(got) - len(ids))
    reason = _conversation_reason(tokenizer, unit, position, prepared.inserted_system_prompt, reasoning, rendered)
    return Checked(record, _mismatch(reason, position, ids, got, tokenizer))


def _conversation_reason(tokenizer: Tokenizer, unit: GenerationUnit, position: int, inserted_system_prompt: bool,
                         reasoning: str | None, rendered: str) -> str:
    if position < len(unit.prompt_ids):
        return "trainer_system_prompt" if inserted_system_prompt else "prompt_rerender"
    if reasoning and reasoning not in rendered:
        return "reasoning_dropped"
    # The same text tokenized differently is the tokenizer's doing; different text is the template's.
    if rendered.startswith(tokenizer.decode(unit.input_ids, skip_special_tokens=False)):
        return "retokenization"
    return "output_rerender"
