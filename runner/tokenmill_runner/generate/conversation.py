"""Multi-turn regeneration (`mode: all-turns`): which turns a source conversation asks for, what the history of each
turn is, and when the conversation stops. Pure: the pipeline renders, generates and decodes; this decides.

Rules (the trainers' notes, section 6, where sound; differences marked):
- The source's assistant messages are targets, never history: turn k is the model's answer to the system, user and
  tool messages of the source up to the k-th assistant message, with the model's own answers 1..k-1 in place of the
  source's. A conversation that ends with a user (or tool) message gets one more turn, answering it.
- The model's answer enters the history as the template expects an assistant message: `content`,
  `reasoning_content` (the tokens before the end of reasoning) and `tool_calls` parsed from its own output; the
  template decides what of it survives (both trainers strip reasoning themselves instead; for templates that drop
  history reasoning the result is the same, for templates that keep it inside tool-call loops (Kimi, Qwen3) this
  renders what a reasoning-returning client sends).
- Tool calls: when the source's assistant turn called tools, the model's calls are paired with them by position
  (`tool_calls.divergence`: same function, same argument names); on a match the source's tool results follow with
  the model's call ids; otherwise the conversation stops (`tool_divergence`, or `diverged_no_call` when the model
  answered without the call). A source whose calls and results all carry ids gives each call the result with its
  `tool_call_id` (parallel calls are often answered out of order); a result for an id the source never called stops
  the conversation (`tool_divergence`). Without ids results go by position. Results beyond the calls answer nothing
  the model asked and are left out (a stale id would point the template at a call that does not exist).
  speculators checks the name only and splices results for other arguments too; we also require the argument
  names, so a result never answers a request of another shape. A call where the source answered in prose stops as
  `tool_divergence` (there is no result to give).
- An output that opens a tool call (a family's call marker) that no parser reads stops as `unparsed_tool_call`:
  a parser gap must not pass for a model that answered without the call (`diverged_no_call`).
- A turn cut at maxNewTokens ends the conversation (`truncated`), kept and flagged; later turns would condition on
  an answer the model never finished. A turn whose prompt no longer fits stops it (`context_exceeded`).
- The conversation is one slot: committed whole when it stops, never a part of it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..source.prompts import Prompt, RowError
from .tool_calls import ToolCall, calls_start, divergence, has_call_opener, parse_tool_calls, source_calls

STOP_REASONS = ("complete", "truncated", "tool_divergence", "diverged_no_call", "unparsed_tool_call",
                "no_tool_result", "context_exceeded", "template_error")

Decode = Callable[[Sequence[int], bool], str]  # (ids, skip_special_tokens) -> text


@dataclass(frozen=True)
class Answer:
    """A generated turn read back as an assistant message."""

    content: str
    reasoning: str | None
    calls: list[ToolCall]
    unparsed: str | None = None  # the answer's text from a call opener on, when no call in it parsed

    def message(self, turn: int) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            # reasoning_content for Kimi, Qwen3, DeepSeek templates; thinking for GPT-OSS's
            message["reasoning_content"] = message["thinking"] = self.reasoning
        if self.calls:
            message["tool_calls"] = [call.as_message_call(call_id(call, turn, index))
                                     for index, call in enumerate(self.calls)]
        return message


def call_id(call: ToolCall, turn: int, index: int) -> str:
    # Kimi's format carries its id (functions.NAME:IDX); other families get a stable one of ours.
    return call.id or f"call_{turn}_{index}"


# GPT-OSS harmony: every message of the answer names its channel (analysis = reasoning, final = the answer,
# commentary = tool calls); skipping special tokens would glue the channel names onto the text.
HARMONY_MESSAGE = re.compile(r"<\|channel\|>(\w+)(?:(?!<\|message\|>).)*<\|message\|>(.*?)"
                             r"(?=<\|end\|>|<\|return\|>|<\|call\|>|<\|start\|>|$)", re.DOTALL)


def _harmony_answer(text: str) -> Answer | None:
    found = HARMONY_MESSAGE.findall(text)
    if not found:
        return None
    reasoning = "".join(body for channel, body in found if channel == "analysis")
    content = "".join(body for channel, body in found if channel == "final")
    calls = parse_tool_calls(text)
    return Answer(content, reasoning or None, calls, _unparsed(text, calls))


def read_answer(output_ids: list[int], finish_reason: str | None, reasoning_end: int | None,
                reasoning_ends_in_calls: bool, tool_call_id: int | None, decode: Decode) -> Answer:
    """The assistant message of a generated turn. `reasoning_end` is the index of the token that ended reasoning;
    when that token opens the tool calls (Kimi-K2.5 leaves reasoning by opening the section) it belongs to the
    answer. The stop token that finished the turn is not part of the message (the template adds its own)."""
    body = output_ids[:-1] if finish_reason == "stop" and output_ids else output_ids
    if harmony := _harmony_answer(decode(body, False)):
        return harmony
    reasoning = None
    after = body
    if reasoning_end is not None:
        reasoning = decode(body[:reasoning_end], True)
        after = body[reasoning_end:] if reasoning_ends_in_calls else body[reasoning_end + 1:]
    text = decode(after, False)
    calls = parse_tool_calls(text)
    if tool_call_id is not None and tool_call_id in after:
        content = decode(after[:after.index(tool_call_id)], True)
    elif calls:  # a format without a special opener (Llama's bare JSON) has no content besides the call
        cut = calls_start(text)
        content = text[:cut] if cut is not None else ""
    else:
        content = decode(after, True)
    return Answer(content, reasoning, calls, _unparsed(text, calls))


def _unparsed(text: str, calls: list[ToolCall]) -> str | None:
    if calls or not has_call_opener(text):
        return None
    return text[calls_start(text) or 0:][:200]


@dataclass
class Conversation:
    """The state of one conversation being regenerated: the next turn's messages, or why it stopped."""

    prompt: Prompt
    history: list[dict[str, Any]]
    targets: list[int]  # positions of the source's assistant messages; -1 for a final answer to trailing messages
    turn: int = 0
    stop_reason: str | None = None
    stop_detail: str | None = None
    pending_ids: list[int] = field(default_factory=list)  # the current turn's prompt ids, once rendered

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def stop(self, reason: str, detail: str | None = None) -> None:
        self.stop_reason, self.stop_detail = reason, detail

    def next_prompt(self, arguments_as_text: bool = False) -> Prompt:
        """The messages to render for the current turn (the tools stay the row's). The model's call arguments go to
        the template as JSON objects, as SGLang's chat API hands history calls to templates (v0.5.23
        entrypoints/openai/serving_chat.py:198-214, applied at :2041-2044); `arguments_as_text` keeps the text the
        model wrote, for templates that concatenate it as a string (DeepSeek-R1's fails on an object)."""
        history = self.history if arguments_as_text else [_arguments_as_objects(m) for m in self.history]
        return Prompt(self.prompt.line, self.prompt.sample_id, list(history), self.prompt.tools)

    def advance(self, answer: Answer, finish_reason: str | None) -> None:
        """Take the model's answer to the current turn: extend the history for the next turn, or stop."""
        messages = self.prompt.messages
        position = self.targets[self.turn]
        turn = self.turn
        self.turn += 1
        if finish_reason == "length":
            return self.stop("truncated", f"turn {turn} reached maxNewTokens")
        if answer.unparsed is not None:
            return self.stop("unparsed_tool_call", f"turn {turn}: the answer opens a tool call that no parser of "
                             f"tokenmill reads: {answer.unparsed!r}")
        if position < 0:
            return self.stop("complete")
        wanted = source_calls(messages[position])
        if why := divergence(answer.calls, wanted):
            return self.stop("diverged_no_call" if not answer.calls else "tool_divergence", f"turn {turn}: {why}")
        following = messages[position + 1:self._next_target_position()]
        results = _leading_tools(following)
        paired = pair_results(wanted, results)
        if isinstance(paired, Stop):
            return self.stop(paired.reason, f"turn {turn}: {paired.detail}")
        self.history.append(answer.message(turn))
        for index, result in enumerate(paired):
            self.history.append({**result, "tool_call_id": call_id(answer.calls[index], turn, index)})
        self.history.extend(following[len(results):])
        if self.turn == len(self.targets):
            self.stop("complete")

    def _next_target_position(self) -> int:
        return self.targets[self.turn] if self.turn < len(self.targets) and self.targets[self.turn] >= 0 \
            else len(self.prompt.messages)


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls") if message.get("role") == "assistant" else None
    if not calls:
        return message
    converted = []
    for call in calls:
        arguments = ToolCall(call["function"]["name"], call["function"]["arguments"]).parsed_arguments()
        if isinstance(arguments, dict):
            call = {**call, "function": {**call["function"], "arguments": arguments}}
        converted.append(call)
    return {**message, "tool_calls": converted}


@dataclass(frozen=True)
class Stop:
    reason: str
    detail: str


def pair_results(calls: Sequence[ToolCall], results: list[dict[str, Any]]) -> list[dict[str, Any]] | Stop:
    """The source's result for each of the source's `calls`, in call order: by `tool_call_id` when every call and
    every result carries one, by position otherwise. Results beyond the calls are left out."""
    ids = [str(call.id) for call in calls if call.id]
    by_id = bool(calls) and len(ids) == len(calls) and all(result.get("tool_call_id") for result in results)
    if not by_id:
        if len(results) < len(calls):
            return Stop("no_tool_result", f"the source has {len(results)} tool result(s) for {len(calls)} call(s)")
        return results[:len(calls)]
    found: dict[str, dict[str, Any]] = {}
    for result in results:
        key = str(result["tool_call_id"])
        if key not in ids:
            return Stop("tool_divergence", f"the source has a tool result for call id {key!r}, which none of its "
                        f"calls ({', '.join(ids)}) has")
        found.setdefault(key, result)
    missing = [key for key in ids if key not in found]
    if missing:
        return Stop("no_tool_result", f"the source has no tool result for call id(s) {', '.join(missing)}")
    return [found[key] for key in ids]


def _leading_tools(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        if message.get("role") != "tool":
            break
        out.append(message)
    return out


def start(prompt: Prompt) -> Conversation | RowError:
    """The conversation of a source row, or why it cannot be regenerated turn by turn."""
    messages = prompt.messages
    assistants = [index for index, message in enumerate(messages) if message.get("role") == "assistant"]
    opening = messages[:assistants[0]] if assistants else messages
    where = f"line {prompt.line} (sample {prompt.sample_id})"
    if not any(message.get("role") == "user" for message in opening):
        return RowError(prompt.line, prompt.sample_id, "no_user_turn",
                        f"{where}: mode all-turns needs a user message before the first assistant message")
    for previous, index in zip(assistants, assistants[1:], strict=False):
        if index == previous + 1:
            return RowError(prompt.line, prompt.sample_id, "consecutive_assistant_turns",
                            f"{where}: messages[{previous}] and messages[{index}] are both assistant messages; "
                            "merge them (mode all-turns regenerates one answer per turn)")
    targets = list(assistants)
    if not assistants or assistants[-1] != len(messages) - 1:
        targets.append(-1)
    return Conversation(prompt, list(opening), targets)


def history_exact(previous_prompt: list[int], previous_output: list[int], prompt: list[int]) -> bool:
    """Whether a turn's prompt ids extend the previous turn's prompt + output ids token for token (False where the
    template re-renders the history differently, e.g. dropping reasoning the model generated)."""
    head = previous_prompt + previous_output
    return len(prompt) >= len(head) and prompt[:len(head)] == head


# A history with one tool call, rendered through the model's template at start: the call must read back.
PROBE = Prompt(0, "tool-call-probe", [
    {"role": "user", "content": "Weather in Porto?"},
    {"role": "assistant", "content": "", "tool_calls": [ToolCall("get_weather", '{"city": "Porto"}').as_message_call(
        "call_0_0")]},
    {"role": "tool", "tool_call_id": "call_0_0", "content": "18 C"}], None)


def unread_call_format(render: Callable[[Prompt], str | RowError], dataset: str, family: str) -> str | None:
    """Why `mode: all-turns` cannot run on this template: it writes an assistant's tool call in a form no parser of
    tokenmill reads, so every tool turn would stop as `unparsed_tool_call` (or, without an opener we know, as
    `diverged_no_call`) after spending its GPU time. None when the call reads back, when the template does not write
    calls at all (nothing to parse), or when it fails on the history (turns then stop as `template_error`)."""
    rendered = render(Conversation(PROBE, list(PROBE.messages), []).next_prompt())
    if not isinstance(rendered, str):
        rendered = render(Conversation(PROBE, list(PROBE.messages), []).next_prompt(arguments_as_text=True))
    if not isinstance(rendered, str) or "Weather in Porto?" not in rendered or "18 C" not in rendered:
        return None
    history = rendered[rendered.index("Weather in Porto?") + len("Weather in Porto?"):rendered.index("18 C")]
    # Llama writes the call as the whole message, bare JSON between the role headers: read that part alone too.
    bare = history[history.find('{"name"'):history.rfind("}") + 1] if '{"name"' in history else ""
    if "get_weather" not in history or any(call.name == "get_weather" for text in (history, bare)
                                           for call in parse_tool_calls(text)):
        return None
    return (f"dataset {dataset}: mode all-turns needs the model's tool calls read back from its output, and the "
            f"chat template of model family {family} writes a call as {history.strip()[:160]!r}, which no tool-call "
            "parser of tokenmill reads (supported families: docs/multiturn.md); use mode last-turn for this dataset")
