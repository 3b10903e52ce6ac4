"""SGLang's own wheels, read as shipped: `pip download sglang==X --no-deps` once per release into
~/.cache/tokenmill/sglang-wheels/ (5-40 MB each; TOKENMILL_CACHE moves it), then files read straight from the zip.

`module_lists(version)` gives the attention-backend lists of the release's argument module (ast, no import), and
`function_source(version, path, name)` the source of one function, for release_code.py to run.
"""

from __future__ import annotations

import ast
import fcntl
import os
import subprocess
import sys
import zipfile
from functools import cache
from pathlib import Path
from types import ModuleType

# Where the lists live: server_args.py through 0.5.19, arg_groups/choices.py from 0.5.20.
LIST_FILES = ("sglang/srt/server_args.py", "sglang/srt/arg_groups/choices.py")
LISTS = ("ATTENTION_BACKEND_CHOICES", "DETERMINISTIC_ATTENTION_BACKEND_CHOICES",
         "RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND")


def cache_root() -> Path:
    return Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill")) / "sglang-wheels"


@cache
def wheel(version: str) -> Path:
    target = cache_root()
    target.mkdir(parents=True, exist_ok=True)
    found = sorted(target.glob(f"sglang-{version}-*.whl"))
    if found:
        return found[0]
    with open(target / ".download.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test workers download each wheel once
        found = sorted(target.glob(f"sglang-{version}-*.whl"))
        if not found:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                            "--no-deps", f"sglang=={version}", "-d", str(target)], check=True, timeout=600)
            found = sorted(target.glob(f"sglang-{version}-*.whl"))
    assert found, f"pip download sglang=={version} left no wheel in {target}"
    return found[0]


@cache
def source(version: str, path: str) -> str | None:
    with zipfile.ZipFile(wheel(version)) as archive:
        try:
            return archive.read(path).decode()
        except KeyError:
            return None


@cache
def tree(version: str, path: str) -> ast.Module | None:
    text = source(version, path)
    return ast.parse(text) if text else None


@cache
def module_lists(version: str) -> dict[str, list[str]]:
    """The module-level backend lists, as the release's module assigns them."""
    found: dict[str, list[str]] = {}
    for path in LIST_FILES:
        module = tree(version, path)
        for node in module.body if module else ():
            if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                    and node.targets[0].id in LISTS and isinstance(node.value, ast.List)):
                found[node.targets[0].id] = [ast.literal_eval(item) for item in node.value.elts]
    return found


def function_node(version: str, path: str, name: str) -> ast.FunctionDef | None:
    module = tree(version, path)
    for node in ast.walk(module) if module else ():
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    return None


def list_holding(node: ast.FunctionDef, item: str) -> list[str]:
    """The list literal inside a function that holds `item` (e.g. the deterministic check's DeepSeek list)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.List) and any(isinstance(e, ast.Constant) and e.value == item for e in sub.elts):
            return [ast.literal_eval(e) for e in sub.elts]
    raise AssertionError(f"no list with {item!r} in {node.name}")


def keyword_fields(version: str, path: str, name: str) -> list[str] | None:
    """The keywords class `name` of a release's module takes: its __init__'s parameters when it defines one, else its
    annotated fields (a dataclass or a msgspec.Struct; ClassVar annotations excluded). None when the class is absent."""
    module = tree(version, path)
    for node in ast.walk(module) if module else ():
        if not (isinstance(node, ast.ClassDef) and node.name == name):
            continue
        init = next((item for item in node.body if isinstance(item, ast.FunctionDef) and item.name == "__init__"),
                    None)
        if init is not None:
            return [arg.arg for arg in (*init.args.args, *init.args.kwonlyargs) if arg.arg != "self"]
        return [item.target.id for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                and "ClassVar" not in ast.unparse(item.annotation)]
    return None


@cache
def api_types(version: str) -> ModuleType | None:
    """The release's JSON contract module (`sglang/api/v1/api_types.py`, 0.5.22+), loaded on its own from the wheel:
    generated code that needs only msgspec, so its decoders judge a body exactly as the server's gate does (0.5.22
    entrypoints/http_server.py:921, entrypoints/api_contract.py). None before 0.5.22."""
    text = source(version, "sglang/api/v1/api_types.py")
    if text is None:
        return None
    module = ModuleType(f"sglang_{version.replace('.', '_')}_api_types")
    sys.modules[module.__name__] = module  # msgspec resolves the Structs' string annotations through it
    exec(compile(text, f"sglang-{version}/sglang/api/v1/api_types.py", "exec"), module.__dict__)  # noqa: S102
    return module
