"""Tool calls in a model's own output text, per model family, and the rule that pairs them with a source's calls.
Pure.

The text is the output decoded with special tokens kept (the markers are special tokens). Formats, as the
families' chat templates render an assistant's calls and as SGLang's function-call detectors read them (the same
detectors ship in v0.5.9 and v0.5.23, python/sglang/srt/function_call/; lines cited from v0.5.23):

- Kimi K2/K2.5: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
  {json}<|tool_call_end|>...<|tool_calls_section_end|>`; the call id is `functions.NAME:IDX` (kimik2_detector.py).
- Qwen2.5/Qwen3 (Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call
  (qwen25_detector.py).
- Qwen3-Coder: `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>...</function>\\n</tool_call>`
  (qwen3_coder_detector.py:27-42, one newline around a value stripped at :213-216).
- GLM-4.5/4.6: `<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>...</tool_call>`; GLM-4.7
  drops the newline after the name (glm4_moe_detector.py:175-183, glm47_moe_detector.py:316-324).
- DeepSeek V3/R1: `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`
  (deepseekv3_detector.py).
- DeepSeek V3.1: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>` (deepseekv31_detector.py:47-51).
- DeepSeek V3.2 (DSML): `<｜DSML｜function_calls><｜DSML｜invoke name="NAME"><｜DSML｜parameter name="KEY"
  string="true|false">VALUE</｜DSML｜parameter>...</｜DSML｜invoke></｜DSML｜function_calls>`, or a JSON object as the
  invoke's body (deepseekv32_detector.py:85-100, values at :130-190); V4 names the block `tool_calls`
  (deepseekv4_detector.py:60), V4.1 writes a space before each tag name (deepseekv41_detector.py:12-14; v0.5.23
  only).
- MiniMax-M2: `<minimax:tool_call><invoke name="NAME"><parameter name="KEY">VALUE</parameter>...</invoke>
  </minimax:tool_call>`, newlines around a value stripped (minimax_m2.py:32-45, 478-495).
- Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` or (tekken v11+) `[TOOL_CALLS]NAME[ARGS]{...}`.
- GPT-OSS (harmony): `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`.
- Llama 3.1/3.2: an answer that is only `{"name": ..., "parameters": {...}}` (after `<|python_tag|>` or not).

The first format that matches the text wins; text with none of the markers has no calls. The XML formats carry
values as text: a value that reads as JSON is taken as JSON, any other as a string (SGLang converts by the tool's
schema instead; the templates print a string and a JSON scalar the same way, so the history renders alike).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the JSON text as the model wrote it (or as the source gave it)
    id: str | None = None  # the call id the format carries (Kimi), else None

    def parsed_arguments(self) -> Any:
        """The arguments as JSON, or None when they are not valid JSON."""
        try:
            return json.loads(self.arguments) if self.arguments.strip() else {}
        except ValueError:
            return None

    def as_message_call(self, call_id: str) -> dict[str, Any]:
        """The call as an OpenAI-style assistant `tool_calls` entry, the shape chat templates read."""
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


KIMI_SECTION = "<|tool_calls_section_begin|>"
KIMI_CALL = re.compile(r"<\|tool_call_begin\|>\s*(.*?)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.DOTALL)
KIMI_ID = re.compile(r"(?:functions\.)?([\w.\-]+):\d+")
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# One <tool_call> block: Hermes JSON, Qwen3-Coder's <function=...> or GLM's NAME + <arg_key>/<arg_value> pairs.
CODER_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
CODER_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)
GLM_CALL = re.compile(r"([^<\n]*?)\s*((?:<arg_key>.*)?)$", re.DOTALL)
GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
# V3/R1 write `function<｜tool▁sep｜>NAME` and fence the JSON; V3.1 writes `NAME<｜tool▁sep｜>{json}`.
DEEPSEEK_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
DEEPSEEK_V3_BODY = re.compile(r"\s*([\w.\-]+)\s*(?:```(?:json)?\s*)?(.*?)\s*(?:```)?\s*$", re.DOTALL)
DSML = "｜DSML｜"
DSML_INVOKE = re.compile(r'<｜DSML｜ ?invoke\s+name="([^"]+)"\s*(?:/>|>(.*?)</｜DSML｜ ?invoke>)', re.DOTALL)
DSML_PARAMETER = re.compile(r'<｜DSML｜ ?parameter\s+name="([^"]+)"\s+string="([^"]+)"\s*>(.*?)</｜DSML｜ ?parameter>',
                            re.DOTALL)
MINIMAX_BLOCK = re.compile(r"<minimax:tool_call>(.*?)</minimax:tool_call>", re.DOTALL)
MINIMAX_INVOKE = re.compile(r'<invoke name="([^"]+)">(.*?)</invoke>', re.DOTALL)
MINIMAX_PARAMETER = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.DOTALL)
MISTRAL_MARK = "[TOOL_CALLS]"
MISTRAL_V11_CALL = re.compile(r"\[TOOL_CALLS\]\s*([\w.\-]+)\s*\[ARGS\]\s*(\{.*?\})(?=\s*(?:\[TOOL_CALLS\]|</s>|$))",
                              re.DOTALL)
# `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{...}<|call|>` as the template renders
# it, or `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` as the model writes it.
HARMONY_CALL = re.compile(r"to=functions\.([\w.\-]+)(?:(?!<\|message\|>).)*<\|message\|>(.*?)"
                          r"(?:<\|call\|>|<\|end\|>|$)", re.DOTALL)
LLAMA_TAG = "<|python_tag|>"
# Where the calls begin in the text: whatever precedes it is the answer's visible content.
CALL_OPENERS = (KIMI_SECTION, "<tool_call>", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<" + DSML,
                "<minimax:tool_call>", MISTRAL_MARK, "<|channel|>commentary to=functions.", "to=functions.", LLAMA_TAG)


def _kimi(text: str) -> list[ToolCall]:
    # The call id is `functions.NAME:IDX` (K2 also writes bare `NAME:IDX`, or a counter, kimik2_detector.py:70)
    calls = []
    for call_id, arguments in KIMI_CALL.findall(text):
        named = KIMI_ID.fullmatch(call_id)
        calls.append(ToolCall(named.group(1) if named else call_id, arguments.strip(), call_id))
    return calls


def _named_json(blob: str) -> ToolCall | None:
    try:
        value = json.loads(blob)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCall(value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                                          ensure_ascii=False))


def _xml_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _from_pairs(name: str, pairs: list[tuple[str, str]]) -> ToolCall | None:
    name = name.strip()
    if not name:
        return None
    arguments = {key.strip(): _xml_value(value) for key, value in pairs}
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _coder_block(block: str) -> list[ToolCall]:
    calls = []
    for name, body in CODER_FUNCTION.findall(block):
        # One newline on each side of a value belongs to the format (qwen3_coder_detector.py:213-216).
        pairs = [(key, value.removeprefix("\n").removesuffix("\n")) for key, value in CODER_PARAMETER.findall(body)]
        call = _from_pairs(name, pairs)
        if call is not None:
            calls.append(call)
    return calls


def _glm_block(block: str) -> list[ToolCall]:
    found = GLM_CALL.match(block)
    if found is None:
        return []
    call = _from_pairs(found.group(1), GLM_ARGUMENT.findall(found.group(2)))
    return [call] if call is not None else []


def _tool_call_blocks(text: str) -> list[ToolCall]:
    """`<tool_call>` blocks: the three families that share the tag differ in what the block holds."""
    calls: list[ToolCall] = []
    for block in HERMES_CALL.findall(text):
        if block.startswith("{"):
            call = _named_json(block)
            calls.extend([call] if call is not None else [])
        elif block.startswith("<function="):
            calls.extend(_coder_block(block))
        else:
            calls.extend(_glm_block(block))
    return calls


def _deepseek(text: str) -> list[ToolCall]:
    calls = []
    for head, body in DEEPSEEK_CALL.findall(text):
        if body.strip().startswith("{"):  # V3.1: the name before the separator, the JSON bare
            calls.append(ToolCall(head.strip(), body.strip()))
        elif found := DEEPSEEK_V3_BODY.match(body):  # V3/R1: the call's type before it, the name after
            calls.append(ToolCall(found.group(1), found.group(2).strip()))
    return calls


def _dsml_arguments(body: str) -> str | None:
    body = body.strip()
    if body.startswith("{"):
        return body
    parameters = DSML_PARAMETER.findall(body)
    if not parameters and body:
        return None  # neither JSON nor parameter tags: SGLang drops such an invoke (deepseekv32_detector.py:170-178)
    # string="true" marks a string value, taken stripped; others are JSON (deepseekv32_detector.py:160-168)
    arguments = {key: value.strip() if kind == "true" else _xml_value(value.strip())
                 for key, kind, value in parameters}
    return json.dumps(arguments, ensure_ascii=False)


def _dsml(text: str) -> list[ToolCall]:
    calls = []
    for name, body in DSML_INVOKE.findall(text):
        arguments = _dsml_arguments(body)
        if arguments is not None:
            calls.append(ToolCall(name.strip(), arguments))
    return calls


def _minimax(text: str) -> list[ToolCall]:
    calls = []
    for block in MINIMAX_BLOCK.findall(text):
        for name, body in MINIMAX_INVOKE.findall(block):
            pairs = [(key, value.strip("\n")) for key, value in MINIMAX_PARAMETER.findall(body)]
            call = _from_pairs(name, pairs)
            calls.extend([call] if call is not None else [])
    return calls


def _mistral(text: str) -> list[ToolCall]:
    if MISTRAL_MARK not in text:
        return []
    if found := MISTRAL_V11_CALL.findall(text):
        return [ToolCall(name, arguments) for name, arguments in found]
    body = text.split(MISTRAL_MARK, 1)[1].replace("</s>", "").strip()
    try:
        value = json.loads(body)
    except ValueError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = [_named_json(json.dumps(item)) for item in items if isinstance(item, dict)]
    return [call for call in calls if call is not None]


def _llama(text: str) -> list[ToolCall]:
    """Llama 3.1/3.2: the whole answer is `{"name": ..., "parameters": {...}}`, after `<|python_tag|>` or not
    (llama32_detector.py); several calls are separated by `;`."""
    body = text.replace(LLAMA_TAG, "").strip()
    for end in ("<|eot_id|>", "<|eom_id|>"):
        body = body.removesuffix(end).strip()
    if not body.startswith("{"):
        return []
    calls = [_named_json(part) for part in body.split(";")] if ";" in body else [_named_json(body)]
    return [] if any(call is None for call in calls) else [call for call in calls if call is not None]


def _harmony(text: str) -> list[ToolCall]:
    return [ToolCall(name, arguments.strip()) for name, arguments in HARMONY_CALL.findall(text)]


PARSERS: tuple[tuple[str, Callable[[str], list[ToolCall]]], ...] = (
    ("<|tool_call_begin|>", _kimi), ("<tool_call>", _tool_call_blocks), ("<｜tool▁call▁begin｜>", _deepseek),
    (DSML, _dsml), ("<minimax:tool_call>", _minimax), (MISTRAL_MARK, _mistral), ("to=functions.", _harmony),
)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The calls in an output's text (special tokens kept), in order; [] when it has none."""
    for mark, parser in PARSERS:
        if mark in text:
            return parser(text)
    return _llama(text)


def has_call_opener(text: str) -> bool:
    """Whether the text opens a tool call in a format tokenmill knows, parsed or not."""
    return any(opener in text for opener in CALL_OPENERS)


def calls_start(text: str) -> int | None:
    """Index in `text` where the tool calls begin, or None."""
    found = [text.index(opener) for opener in CALL_OPENERS if opener in text]
    return min(found) if found else None


def source_calls(message: dict[str, Any]) -> list[ToolCall]:
    """A source assistant message's `tool_calls` (OpenAI shape; arguments a JSON string or an object)."""
    calls = []
    for entry in message.get("tool_calls") or []:
        function = entry.get("function", entry) if isinstance(entry, dict) else {}
        arguments = function.get("arguments", {})
        calls.append(ToolCall(str(function.get("name", "")),
                              arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False),
                              entry.get("id") if isinstance(entry, dict) else None))
    return calls


def _keys(call: ToolCall) -> frozenset[str] | None:
    arguments = call.parsed_arguments()
    return frozenset(arguments) if isinstance(arguments, dict) else None


def same_call(model: ToolCall, source: ToolCall) -> bool:
    """The splice rule: the model's call may receive the source's cached result when it calls the same function
    with the same argument names (both parsed as JSON objects). Values may differ: a result for
    `get_weather(city="Porto")` after the model asked for `get_weather(city="Lisbon")` is the price of reusing cached
    results at all, and requiring equal values would stop nearly every sampled conversation at its first call.
    Unequal names of arguments mean a different request (another mode of the tool), which stops."""
    if model.name != source.name:
        return False
    model_keys, source_keys = _keys(model), _keys(source)
    return model_keys is not None and model_keys == source_keys


def divergence(model: Sequence[ToolCall], source: Sequence[ToolCall]) -> str | None:
    """Why the model's calls cannot be answered with the source's results, or None when each call pairs with the
    source's call at the same position by `same_call`."""
    if not model and source:
        return f"the model answered without a tool call where the source called {_names(source)}"
    if model and not source:
        return f"the model called {_names(model)} where the source answered without a tool call"
    if len(model) != len(source):
        return f"the model called {_names(model)} where the source called {_names(source)}"
    for mine, theirs in zip(model, source, strict=True):
        if not same_call(mine, theirs):
            return (f"the model called {mine.name}({mine.arguments}) where the source called "
                    f"{theirs.name}({theirs.arguments})")
    return None


def _names(calls: Sequence[ToolCall]) -> str:
    return ", ".join(call.name for call in calls) or "nothing"
