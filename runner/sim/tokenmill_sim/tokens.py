"""What the simulated model "generates": token sequences with a real model's structure, deterministic per prompt.

An output is reasoning text, `</think>`, then an answer, a Kimi-format tool-call section (when the prompt declares
tools) or, rarely, a short clarifying question, then the end-of-sequence token. Every special id is looked up in the
tokenizer; nothing here hard-codes an id. The functions take `encode`/`decode` callables rather than a tokenizer so
the structure can be tested on its own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import textbank
from .profiles import CLARIFICATION_REASONING_TOKENS, CLARIFICATION_SHARE, LengthProfile, choose_profile

logger = logging.getLogger(__name__)

Encode = Callable[[str], list[int]]
Decode = Callable[[Sequence[int], bool], str]  # (ids, skip_special_tokens) -> text

THINK_END = "</think>"
# The token that closes reasoning, by family: </think> (Kimi, DeepSeek-R1, Qwen3), [/THINK] (Mistral tekken v13),
# <|end|> (GPT-OSS: the end of the harmony analysis message). A tokenizer with none of them models no reasoning.
REASONING_END_CANDIDATES = (THINK_END, "[/THINK]", "<|end|>")
TOOL_CALL_SHARE = 0.6  # of prompts that declare tools, the share answered with a tool call
# Of Kimi-format tool-call answers, the share that leaves reasoning by opening the tool-call section without
# </think>, as Kimi-K2.5 does (SGLang's kimi_k2 reasoning parser accepts that token as the end of reasoning).
SECTION_ENDS_REASONING_SHARE = 0.3
SECOND_CALL_SHARE = 0.15  # of tool-call answers, the share with two calls
FILL_BATCH = 32  # sentences drawn per RNG call
TOOL_TOKENS = {
    "section_begin": "<|tool_calls_section_begin|>",
    "section_end": "<|tool_calls_section_end|>",
    "call_begin": "<|tool_call_begin|>",
    "argument_begin": "<|tool_call_argument_begin|>",
    "call_end": "<|tool_call_end|>",
}
DECLARE_TOKENS = {"system": "<|im_system|>", "middle": "<|im_middle|>", "end": "<|im_end|>"}
USER_TOKEN, ASSISTANT_TOKEN = "<|im_user|>", "<|im_assistant|>"
# Of turns whose user message asks for a tool (names it), the share where the model does something else: calls
# another declared tool, or answers without a call when only one is declared. Multi-turn regeneration stops there,
# so the demo shows both conversations that run to the end and ones that diverge.
DIVERGENCE_SHARE = 0.15
GENERIC_NAME_WORDS = frozenset({"get", "set", "list", "current", "info", "data", "from", "with", "make", "create",
                                "find", "check", "fetch", "lookup", "query", "tool", "function"})


@dataclass(frozen=True)
class Vocabulary:
    """The ids the generator needs, resolved from one tokenizer."""

    eos_ids: frozenset[int]  # config ∪ generation_config ∪ tokenizer eos: the default token stops
    eos: int  # the one the model emits at the end of a turn
    think_end: int | None  # None: a model without reasoning (e.g. Llama 3.1)
    tool: Mapping[str, int] | None  # TOOL_TOKENS keys -> ids; None when the tokenizer lacks them
    declare: Mapping[str, int] | None  # DECLARE_TOKENS keys -> ids
    tool_declare: tuple[int, ...]  # ids of the text "tool_declare" after <|im_system|>
    user: int | None = None  # <|im_user|>: where the latest user message begins (Kimi's template)
    assistant: int | None = None  # <|im_assistant|>: an earlier answer in the history

    @classmethod
    def resolve(cls, token_to_id: Mapping[str, int], encode: Encode, eos_ids: Iterable[int],
                primary_eos: int | None) -> Vocabulary:
        eos_set = frozenset(eos_ids)
        if not eos_set:
            raise ValueError("no end-of-sequence id in config.json, generation_config.json or the tokenizer")
        eos = primary_eos if primary_eos in eos_set else min(eos_set)
        return cls(
            eos_ids=eos_set,
            eos=eos,
            think_end=next((token_to_id[t] for t in REASONING_END_CANDIDATES if t in token_to_id), None),
            tool=_lookup(token_to_id, TOOL_TOKENS),
            declare=_lookup(token_to_id, DECLARE_TOKENS),
            tool_declare=tuple(encode("tool_declare")),
            user=token_to_id.get(USER_TOKEN),
            assistant=token_to_id.get(ASSISTANT_TOKEN),
        )


def _lookup(token_to_id: Mapping[str, int], names: Mapping[str, str]) -> dict[str, int] | None:
    if not all(token in token_to_id for token in names.values()):
        return None
    return {key: token_to_id[token] for key, token in names.items()}


@dataclass(frozen=True)
class Piece:
    """A run of output tokens and its text as SGLang decodes it by default (special tokens skipped)."""

    ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class TokenBank:
    """Pre-tokenized sentences, so building an output is list concatenation, not tokenization."""

    reasoning: tuple[Piece, ...]
    answer: tuple[Piece, ...]
    clarification: tuple[Piece, ...]

    @classmethod
    def build(cls, encode: Encode, decode: Decode) -> TokenBank:
        def tokenize(sentences: Iterable[str]) -> tuple[Piece, ...]:
            pieces = (tuple(encode(s)) for s in sentences)
            return tuple(Piece(ids, decode(ids, True)) for ids in pieces)

        return cls(tokenize(textbank.REASONING), tokenize(textbank.ANSWER), tokenize(textbank.CLARIFICATION))

    def all_pieces(self) -> tuple[Piece, ...]:
        return self.reasoning + self.answer + self.clarification


@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: Mapping[str, Any] = field(default_factory=dict)  # JSON schema of the arguments


@dataclass(frozen=True)
class OutputPlan:
    """Everything random about one prompt's output, drawn once from hash(seed, prompt)."""

    profile: str
    kind: str  # answer | tool_call | clarification
    length: int  # target natural length in tokens (the materialized length may overshoot by one sentence)
    reasoning: int  # target tokens before </think>
    tool_calls: tuple[tuple[str, str], ...]  # (function name, JSON arguments)
    text_seed: int  # seeds the sentence choice
    section_ends_reasoning: bool = False  # a tool call opens right after the reasoning, with no end token


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128  # SGLang's default, far too small for reasoning models
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None  # per-request seed: another seed draws another output for the same prompt


@dataclass(frozen=True)
class Draft:
    """A prefix of an output's natural token sequence, with the text of each whole piece in it."""

    ids: list[int]
    marks: list[tuple[int, str]]  # (end offset in ids, text of the piece ending there), for whole pieces only


@dataclass(frozen=True)
class Finished:
    output_ids: list[int]
    finish_reason: dict[str, Any]  # SGLang's shape: {type: stop, matched} | {type: length, length}
    matched_stop: int | None
    marks: list[tuple[int, str]] = field(default_factory=list)  # piece texts, to build `text` without decoding


def prompt_digest(seed: int, input_ids: Sequence[int], sampling_seed: int | None = None) -> int:
    """A 64-bit digest of (seed, prompt[, the request's sampling_seed]): the only source of randomness for a prompt's
    output. Without a request seed it is what it always was, so outputs of runs without seeds do not change.

    The simulator always honours the request seed, as SGLang does only with `--enable-deterministic-inference`
    (0.5.23 `sampling/sampling_batch_info.py:128` builds the per-row seeds only when deterministic; without the flag
    torch's RNG draws). Both ways, two samples of one prompt differ; only the deterministic server repeats a sample
    on a rerun, and the simulator stands in for that one (docs/sglang-release-facts.md, sampling_seed)."""
    payload = seed.to_bytes(8, "little", signed=True) + array("q", input_ids).tobytes()
    if sampling_seed is not None:
        payload += b"s" + sampling_seed.to_bytes(8, "little", signed=True)
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")


def find_sequence(haystack: Sequence[int], needle: Sequence[int], start: int = 0) -> int:
    """Index of the first occurrence of `needle` in `haystack` at or after `start`, or -1."""
    if not needle:
        return -1
    first = needle[0]
    size = len(needle)
    while True:
        try:
            index = haystack.index(first, start)
        except ValueError:
            return -1
        if list(haystack[index:index + size]) == list(needle):
            return index
        start = index + 1


def declared_tools(input_ids: Sequence[int], vocab: Vocabulary, decode: Decode) -> tuple[ToolSpec, ...]:
    """Tools declared in the prompt's `<|im_system|>tool_declare<|im_middle|>[...]<|im_end|>` block, if any."""
    if vocab.declare is None or not vocab.tool_declare:
        return ()
    marker = [vocab.declare["system"], *vocab.tool_declare, vocab.declare["middle"]]
    begin = find_sequence(input_ids, marker)
    if begin < 0:
        return ()
    body_start = begin + len(marker)
    try:
        body_end = list(input_ids).index(vocab.declare["end"], body_start)
    except ValueError:
        return ()
    text = decode(input_ids[body_start:body_end], False)
    try:
        declared = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        # Kimi-K2.5's own tokenizer code declares tools TypeScript-style (tools_ts_str), not as JSON.
        return typescript_tools(text)
    return tuple(_tool_specs(declared))


TS_FUNCTION = re.compile(r"^type (\w+) = \(_: \{\n(.*?)\n\}\) => any;", re.MULTILINE | re.DOTALL)
TS_FIELD = re.compile(r"^  (\w+)(\??): ([^\s,]+)", re.MULTILINE)
TS_TYPES = {"string": "string", "number": "number", "boolean": "boolean"}


def typescript_tools(text: str) -> tuple[ToolSpec, ...]:
    """Tools from a `namespace functions { type NAME = (_: {...}) => any; }` declaration: the names, and each
    top-level parameter with its scalar type (others become strings), required unless marked `?`."""
    tools = []
    for name, body in TS_FUNCTION.findall(text):
        properties, required = {}, []
        for parameter, optional, kind in TS_FIELD.findall(body):
            properties[parameter] = {"type": TS_TYPES.get(kind, "string")}
            if not optional:
                required.append(parameter)
        tools.append(ToolSpec(name, {"type": "object", "properties": properties, "required": required}))
    return tuple(tools)


def _tool_specs(declared: Any) -> Iterator[ToolSpec]:
    for item in declared if isinstance(declared, list) else []:
        function = item.get("function", item) if isinstance(item, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str) and function["name"]:
            parameters = function.get("parameters")
            yield ToolSpec(function["name"], parameters if isinstance(parameters, dict) else {})


def fake_arguments(parameters: Mapping[str, Any], rng: random.Random) -> dict[str, Any]:
    """Plausible arguments for a JSON schema: every required property, and some optional ones."""
    properties = parameters.get("properties")
    if not isinstance(properties, dict):
        return {}
    required = set(parameters.get("required") or [])
    arguments = {}
    for name, schema in properties.items():
        if name in required or rng.random() < 0.4:
            arguments[name] = _fake_value(schema if isinstance(schema, dict) else {}, rng, name)
    return arguments


def _fake_value(schema: Mapping[str, Any], rng: random.Random, name: str = "") -> Any:
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return rng.choice(schema["enum"])
    kind = schema.get("type")
    if kind == "integer":
        return rng.randint(1, 100)
    if kind == "number":
        return round(rng.uniform(1, 1000), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return [_fake_value(schema.get("items") or {}, rng, name)]
    if kind == "object":
        return fake_arguments(schema, rng)
    if any(hint in name.lower() for hint in ("city", "location", "place", "destination")):
        return rng.choice(textbank.PLACES)
    return rng.choice(textbank.ARGUMENT_WORDS)


def name_words(name: str) -> set[str]:
    """The words of a tool's name a user would say (get_current_weather -> weather)."""
    words = {word.lower() for word in re.split(r"[_\-.\s]+|(?<=[a-z])(?=[A-Z])", name)}
    return {word for word in words if len(word) >= 4 and word not in GENERIC_NAME_WORDS}


@dataclass(frozen=True)
class Requested:
    """The tools the latest user message asks for (a word of the tool's name in its text, in the order the text
    names them), and which of them the assistant has not called since that message."""

    named: tuple[ToolSpec, ...]
    pending: tuple[ToolSpec, ...]
    follow_up: bool = False  # the history before the latest user message holds an answer of the assistant


def requested_tools(input_ids: Sequence[int], vocab: Vocabulary, decode: Decode,
                    tools: Sequence[ToolSpec]) -> Requested | None:
    """What a tool-using model reads from a conversation (Kimi's template): None when the prompt has no user
    message or the tokenizer lacks the markers; `named` empty when the user message names no declared tool."""
    if vocab.user is None or vocab.declare is None or not tools:
        return None
    ids = list(input_ids)
    try:
        begin = len(ids) - 1 - ids[::-1].index(vocab.user)
        end = ids.index(vocab.declare["end"], begin)
    except ValueError:
        return None
    text = decode(ids[begin:end], True).lower()
    found = []
    for tool in tools:
        positions = [text.find(word) for word in name_words(tool.name) if word in text]
        if positions:
            found.append((min(positions), tool.name, tool))
    named = tuple(tool for _, _, tool in sorted(found, key=lambda item: (item[0], item[1])))
    called = set(re.findall(r"functions\.([\w.\-]+):\d+", decode(ids[end:], False)))
    follow_up = vocab.assistant is not None and vocab.assistant in ids[:begin]
    return Requested(named, tuple(tool for tool in named if tool.name not in called), follow_up)


def requested_plan(rng: random.Random, requested: Requested, tools: Sequence[ToolSpec]) -> tuple[str, ...] | None:
    """The tool to call for a user message that asks for tools: the first one not yet called, mostly; another
    declared tool (or none) now and then (DIVERGENCE_SHARE). () once every named tool was called: answer."""
    if not requested.pending:
        return ()
    wanted = requested.pending[0]
    if rng.random() < DIVERGENCE_SHARE:
        others = [tool.name for tool in tools if tool.name != wanted.name]
        return (rng.choice(others),) if others else ()
    return (wanted.name,)


def required_arguments(parameters: Mapping[str, Any], rng: random.Random) -> dict[str, Any]:
    """Arguments for exactly the required properties (what a model does when a user asked for one thing)."""
    required = parameters.get("required") or []
    declared = parameters.get("properties")
    properties: Mapping[str, Any] = declared if isinstance(declared, dict) else {}
    return {name: _fake_value(properties.get(name) or {}, rng, name) for name in required}


def make_plan(digest: int, profile: LengthProfile, tools: Sequence[ToolSpec], can_call_tools: bool,
              requested: Requested | None = None) -> OutputPlan:
    """Draw lengths and the output's kind for one prompt. When the latest user message names declared tools
    (`requested`), the call follows it (see requested_plan) instead of the 60 % draw; a follow-up message in a
    conversation that names none is answered without a call."""
    rng = random.Random(digest)
    length = profile.draw(rng)
    share = rng.uniform(*profile.reasoning_share)
    kind_draw = rng.random()
    tool_draw = rng.random()
    text_seed = rng.getrandbits(64)
    if kind_draw < CLARIFICATION_SHARE:
        reasoning = rng.randint(*CLARIFICATION_REASONING_TOKENS)
        return OutputPlan(profile.name, "clarification", reasoning + 45, reasoning, (), text_seed)
    calls: tuple[tuple[str, str], ...] = ()
    if requested is not None and requested.follow_up and not requested.named:
        pass  # a follow-up that asks for no tool ("thanks", "summarise that") is answered in prose
    elif tools and can_call_tools and requested is not None and requested.named:
        by_name = {tool.name: tool for tool in tools}
        chosen_names = requested_plan(rng, requested, tools) or ()
        calls = tuple((name, json.dumps(required_arguments(by_name[name].parameters, rng), ensure_ascii=False))
                      for name in chosen_names)
    elif tools and can_call_tools and tool_draw < TOOL_CALL_SHARE:
        count = 2 if rng.random() < SECOND_CALL_SHARE else 1
        chosen = [rng.choice(tools) for _ in range(count)]
        calls = tuple((t.name, json.dumps(fake_arguments(t.parameters, rng), ensure_ascii=False)) for t in chosen)
    kind = "tool_call" if calls else "answer"
    skips_end = bool(calls) and rng.random() < SECTION_ENDS_REASONING_SHARE
    return OutputPlan(profile.name, kind, length, max(1, int(length * share)), calls, text_seed, skips_end)


class OutputBuilder:
    """Materializes a plan into token ids, lazily, so a 40k-token plan cut at 2k costs 2k tokens of work."""

    def __init__(self, vocab: Vocabulary, bank: TokenBank, encode: Encode) -> None:
        self.vocab = vocab
        self.bank = bank
        self.encode = encode

    def natural(self, plan: OutputPlan, limit: int) -> Draft:
        """The output through its end-of-sequence token, or its first `limit` tokens if that is shorter."""
        out: list[int] = []
        marks: list[tuple[int, str]] = []
        for piece in self._pieces(plan):
            out.extend(piece.ids)
            if len(out) >= limit:
                if len(out) == limit:
                    marks.append((limit, piece.text))
                return Draft(out[:limit], marks)
            marks.append((len(out), piece.text))
        return Draft(out, marks)

    def continuation(self, plan: OutputPlan, count: int) -> list[int]:
        """What the model babbles after its end-of-sequence token when ignore_eos keeps it going."""
        rng = random.Random(plan.text_seed ^ 0x5EED)
        out: list[int] = []
        while len(out) < count:
            out.extend(rng.choice(self.bank.answer).ids)
        return out[:count]

    def _pieces(self, plan: OutputPlan) -> Iterator[Piece]:
        rng = random.Random(plan.text_seed)
        reasoning = 0
        if self.vocab.think_end is not None:
            for piece in _fill(self.bank.reasoning, plan.reasoning, rng):
                reasoning += len(piece.ids)
                yield piece
            if not (plan.section_ends_reasoning and plan.kind == "tool_call" and self.vocab.tool is not None):
                yield Piece((self.vocab.think_end,), "")
        if plan.kind == "clarification":
            yield rng.choice(self.bank.clarification)
        elif plan.kind == "tool_call" and self.vocab.tool is not None:
            yield self._tool_section(plan.tool_calls)
        else:
            # The answer takes what the reasoning left of the planned length (the reasoning overshoots its
            # target by part of a sentence), so lengths follow the profile closely.
            yield from _fill(self.bank.answer, max(1, plan.length - reasoning - 2), rng)
        yield Piece((self.vocab.eos,), "")

    def _tool_section(self, calls: Sequence[tuple[str, str]]) -> Piece:
        tool = self.vocab.tool
        assert tool is not None
        ids = [tool["section_begin"]]
        text = []
        for index, (name, arguments) in enumerate(calls):
            header = f"functions.{name}:{index}"
            ids += [tool["call_begin"], *self.encode(header), tool["argument_begin"], *self.encode(arguments),
                    tool["call_end"]]
            text += [header, arguments]
        ids.append(tool["section_end"])
        return Piece(tuple(ids), "".join(text))


def _fill(bank: Sequence[Piece], tokens: int, rng: random.Random) -> Iterator[Piece]:
    # Sentences are drawn in fixed batches (one rng.choices call each, much cheaper than one choice per sentence);
    # the batches do not depend on where the output is cut, so every cut is a prefix of the same sequence.
    produced = 0
    while True:
        for piece in rng.choices(bank, k=FILL_BATCH):
            if produced >= tokens:
                return
            produced += len(piece.ids)
            yield piece


def apply_stops(draft: Draft, params: SamplingParams, stop_ids: frozenset[int],
                continuation: Callable[[int], list[int]], eos_at_cap: str = "stop") -> Finished:
    """Cut an output the way SGLang's scheduler does: at the first stop token (kept), else at max_new_tokens.

    `draft` must hold at least min(natural length, max_new_tokens) tokens; `continuation(n)` supplies what
    follows the end-of-sequence token when ignore_eos disables token stops. A stop token sampled as the last
    allowed token finishes as `length` where the release checks the length first (`eos_at_cap`: "length" through
    0.5.17, 0.5.9 managers/schedule_batch.py:1081-1086; "stop" from 0.5.18, 0.5.23
    managers/schedule_batch.py:2034-2043).
    """
    limit = params.max_new_tokens
    head = draft.ids[:limit]
    if params.ignore_eos:
        if len(head) < limit:
            head = head + continuation(limit - len(head))
        return Finished(head, {"type": "length", "length": limit}, None, draft.marks)
    stop_at = _first_stop(head, stop_ids)
    if stop_at is not None and not (stop_at == limit - 1 and eos_at_cap == "length"):
        matched = head[stop_at]
        return Finished(head[:stop_at + 1], {"type": "stop", "matched": matched}, matched, draft.marks)
    return Finished(head, {"type": "length", "length": limit}, None, draft.marks)


NAN_MATCHED = "NaN happened"


def with_nan(finished: Finished, position: int, limit: int, eos: int, bad_id: int, nan_first: bool) -> Finished:
    """The output when the token sampled at `position` fell outside the vocabulary (NaN logits): SGLang overwrites
    it with an end-of-sequence id and finishes with matched "NaN happened" (0.5.9 managers/schedule_batch.py:1056-1070;
    0.5.23 managers/schedule_batch.py:2019). Where the length check runs first (through 0.5.17, `nan_first` False)
    and that token is the last allowed one, the request finishes as `length` and the bad id stays in the output
    (0.5.9 managers/schedule_batch.py:1081-1086 returns before the vocabulary check)."""
    position = min(position, len(finished.output_ids) - 1)
    kept = finished.output_ids[:position]
    if position == limit - 1 and not nan_first:
        return Finished(kept + [bad_id], {"type": "length", "length": limit}, None, finished.marks)
    return Finished(kept + [eos], {"type": "stop", "matched": NAN_MATCHED}, None, finished.marks)


def _first_stop(ids: list[int], stop_ids: frozenset[int]) -> int | None:
    best: int | None = None
    for stop in stop_ids:
        try:
            index = ids.index(stop, 0, len(ids) if best is None else best)
        except ValueError:
            continue
        best = index
    return best


class OutputGenerator:
    """Prompt ids + sampling params -> the finished output, deterministic for (seed, prompt)."""

    def __init__(self, vocab: Vocabulary, bank: TokenBank, encode: Encode, decode: Decode, seed: int,
                 profile: str, eos_at_cap: str = "stop") -> None:
        self.vocab = vocab
        self.eos_at_cap = eos_at_cap
        self.encode = encode
        self.decode = decode
        self.seed = seed
        self.profile = profile
        self.builder = OutputBuilder(vocab, bank, encode)
        self.concatenative = _decodes_piecewise(bank, vocab, decode)
        if not self.concatenative:
            logger.info("this tokenizer does not decode piece by piece; every response text is decoded in full")

    def plan(self, input_ids: Sequence[int], sampling_seed: int | None = None) -> OutputPlan:
        tools = declared_tools(input_ids, self.vocab, self.decode)
        profile = choose_profile(self.profile, len(input_ids), bool(tools))
        requested = requested_tools(input_ids, self.vocab, self.decode, tools) if tools else None
        digest = prompt_digest(self.seed, input_ids, sampling_seed)
        return make_plan(digest, profile, tools, self.vocab.tool is not None, requested)

    def generate(self, input_ids: Sequence[int], params: SamplingParams) -> Finished:
        plan = self.plan(input_ids, params.sampling_seed)
        draft = self.builder.natural(plan, params.max_new_tokens)
        stops = frozenset() if params.ignore_eos else self.vocab.eos_ids | params.stop_token_ids
        return apply_stops(draft, params, stops, lambda n: self.builder.continuation(plan, n), self.eos_at_cap)

    def text(self, finished: Finished, params: SamplingParams) -> str:
        """The response's `text`: like SGLang's detokenizer, the matched stop token is trimmed unless no_stop_trim."""
        ids = finished.output_ids
        end = len(ids) - 1 if finished.matched_stop is not None and not params.no_stop_trim else len(ids)
        if not (params.skip_special_tokens and self.concatenative):
            return self.decode(ids[:end], params.skip_special_tokens)
        # Whole pieces contribute their known text; only a cut piece at the end is decoded (about half the cost
        # of a response otherwise goes to decoding).
        parts: list[str] = []
        start = 0
        for mark, text in finished.marks:
            if mark > end:
                break
            parts.append(text)
            start = mark
        if start < end:
            parts.append(self.decode(ids[start:end], True))
        return "".join(parts)


def _decodes_piecewise(bank: TokenBank, vocab: Vocabulary, decode: Decode) -> bool:
    """Whether decode(a + b) == decode(a) + decode(b) here (true for byte-level BPE on whole characters)."""
    ends = [Piece((vocab.think_end,), "")] if vocab.think_end is not None else []
    pieces = list(bank.all_pieces()) + ends + [Piece((vocab.eos,), "")]
    for first, second in zip(pieces, pieces[1:] + pieces[:1], strict=True):
        if decode(first.ids + second.ids, True) != first.text + second.text:
            return False
    return True
