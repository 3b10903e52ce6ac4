"""Multi-part text content flattened the way SGLang's chat endpoint does it for the model's template. Pure.

SGLang decides once per chat template whether it takes content as a string or as the OpenAI list of parts
(`detect_jinja_template_content_format`, 0.5.9 and 0.5.23 `parser/jinja_template_utils.py:83`): a template that
mentions image/audio/video/vision, or loops over `message.content` (or `msg.content`, `m.content`), gets the list;
every other template gets the text parts joined with a single space (0.5.9 `parser/jinja_template_utils.py:225`;
0.5.23 `parser/jinja_template_utils.py:335`). Kimi-K2.5's template takes the list and concatenates the parts with
no separator; Qwen3's and DeepSeek-R1's take strings (Qwen3's renders a list as an empty string: passing it through
would silently drop the prompt). tokenmill does the same here, so the prompt ids match what SGLang would render.
"""

from __future__ import annotations

from typing import Any, Literal

import jinja2
import jinja2.nodes

ContentFormat = Literal["string", "openai"]
JOIN = " "  # SGLang's separator for string-format templates
_MEDIA_WORDS = ("image", "audio", "video", "vision")
_MESSAGE_NAMES = ("message", "msg", "m")


def template_content_format(chat_template: str | None) -> ContentFormat:
    if not chat_template:
        return "string"
    if any(word in chat_template for word in _MEDIA_WORDS):
        return "openai"
    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do"]).parse(chat_template)
    except jinja2.TemplateError:
        return "string"
    for loop in tree.find_all(jinja2.nodes.For):
        if _reads_content(loop.iter):
            return "openai"
    return "string"


def _reads_content(node: jinja2.nodes.Node) -> bool:
    """`message.content`, `message['content']`, also under filters, tests and slices (as SGLang matches it)."""
    if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)):
        return node.node is not None and _reads_content(node.node)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reads_content(node.node)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
        key = node.arg.value
    elif isinstance(node, jinja2.nodes.Getattr):
        key = node.attr
    else:
        return False
    target = node.node
    return key == "content" and isinstance(target, jinja2.nodes.Name) and target.name in _MESSAGE_NAMES


def flatten(messages: list[dict[str, Any]], fmt: ContentFormat) -> list[dict[str, Any]]:
    """The messages as the template receives them: text-part lists joined with a space for string templates, kept
    for list templates. Messages with string content are returned as they are."""
    if fmt == "openai" or not any(isinstance(m.get("content"), list) for m in messages):
        return messages
    return [{**m, "content": JOIN.join(p["text"] for p in m["content"])} if isinstance(m.get("content"), list) else m
            for m in messages]
