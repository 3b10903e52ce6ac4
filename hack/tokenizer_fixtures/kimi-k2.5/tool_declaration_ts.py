# Test fixture written for tokenmill: a stand-in for the `tool_declaration_ts.py` that moonshotai/Kimi-K2.5 ships
# next to its tokenizer. It turns OpenAI-style tool definitions into the TypeScript-like declaration block the
# model was trained on (see README.md in this folder): a `# Tools` / `## functions` header, a `namespace functions`
# with one `type NAME = (_: {...}) => any;` per function, descriptions and constraints as `//` comments, required
# parameters first (sorted by name), then optional ones marked `?`, enums as string-literal unions, `anyOf` and
# type lists as unions, arrays as `Array<T>`, `$defs` as interfaces. Only what the fixtures exercise is covered.
import json
from typing import Any, Dict, List, Optional

INDENT = "  "
SEPARATOR = ",\n"
CONSTRAINTS = {"string": ("maxLength", "minLength", "pattern"), "number": ("maximum", "minimum"),
               "integer": ("maximum", "minimum"), "array": ("maxItems", "minItems")}
TYPE_NAMES = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean", "null": "null",
              "object": "{}", "array": "Array<any>"}


def _comment(text: str, indent: str) -> str:
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


def _notes(schema: Any, indent: str) -> str:
    """Description and constraint comments that precede a field, each line ending in a newline."""
    if not isinstance(schema, dict):
        return ""
    lines = []
    if schema.get("description"):
        lines.append(_comment(schema["description"], indent))
    kind = schema.get("type") if isinstance(schema.get("type"), str) else None
    found = {key: schema[key] for key in CONSTRAINTS.get(kind, ()) if key in schema}
    if found:
        lines.append(indent + "// " + ", ".join(f"{key}: {found[key]}" for key in sorted(found)))
    return "".join(line + "\n" for line in lines)


def _type(schema: Any, indent: str, defs: Dict[str, Any]) -> str:
    if schema is True or schema == {}:
        return "any"
    if schema is False:
        return "null"
    if "$ref" in schema:
        return schema["$ref"].split("/")[-1] if schema["$ref"] != "#" else "parameters"
    if "anyOf" in schema:
        return " | ".join(_type(option, indent, defs) for option in schema["anyOf"])
    if "enum" in schema:
        return " | ".join(f'"{value}"' if isinstance(value, str) else str(value) for value in schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(TYPE_NAMES[k] for k in kind)
    if kind == "object":
        return _object(schema, indent, defs)
    if kind == "array":
        return _array(schema, indent, defs)
    if kind is None:
        raise ValueError(f"Invalid JSON Schema object: {schema}")
    return "number" if kind == "integer" else kind


def _array(schema: Dict[str, Any], indent: str, defs: Dict[str, Any]) -> str:
    item = schema.get("items") or {}
    notes = _notes(item, indent + INDENT)
    if notes:
        return f"Array<\n{notes}{indent}{INDENT}{_type(item, indent + INDENT, defs)}\n{indent}>"
    return f"Array<{_type(item, indent, defs)}>"


def _field(name: str, schema: Any, optional: bool, indent: str, defs: Dict[str, Any]) -> str:
    text = _notes(schema, indent)
    if isinstance(schema, dict) and schema.get("default") is not None:
        default = schema["default"]
        shown = repr(default) if isinstance(default, (int, float, bool)) else json.dumps(default, ensure_ascii=False)
        text += f"{indent}// Default: {shown}\n"
    return text + f"{indent}{name}{'?' if optional else ''}: {_type(schema, indent, defs)}"


def _object(schema: Dict[str, Any], indent: str, defs: Dict[str, Any]) -> str:
    defs.update(schema.get("$defs") or {})
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    order = sorted(n for n in properties if n in required) + sorted(n for n in properties if n not in required)
    fields = [_field(name, properties[name], name not in required, indent + INDENT, defs) for name in order]
    extra = schema.get("additionalProperties")
    if extra is not None:
        shown = "any" if extra is True else "never" if extra is False else _type(extra, indent + INDENT, defs)
        fields.append(f"{indent}{INDENT}[k: string]: {shown}")
    if not fields:
        return "{}"
    return "{\n" + SEPARATOR.join(fields) + "\n" + indent + "}"


def _function(function: Dict[str, Any]) -> str:
    defs: Dict[str, Any] = {}
    signature = _object(function.get("parameters") or {}, "", defs)
    blocks = []
    for name, schema in dict(defs).items():
        note = _comment(schema["description"], "") + "\n" if schema.get("description") else ""
        blocks.append(f"{note}interface {name} {_type(schema, '', defs)}")
    if function.get("description"):
        blocks.append(_comment(function["description"], ""))
    blocks.append(f"type {function.get('name', 'function')} = (_: {signature}) => any;")
    return "\n".join(blocks)


def encode_tools_to_typescript_style(tools: List[Dict[str, Any]]) -> str:
    if not tools:
        return ""
    functions = [_function(tool["function"]) for tool in tools if tool.get("type") == "function" and tool.get("function")]
    text = "# Tools\n\n"
    if functions:
        text += "## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"
    return text
