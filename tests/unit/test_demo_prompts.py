"""The demo's SWE prompts are data (hack/demo_prompts/), and the generator reproduces the committed file from it."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
GENERATOR = REPO / "hack" / "make_demo_prompts.py"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_demo_prompts", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the models' annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_the_generator_reproduces_the_committed_prompts_byte_for_byte(tmp_path: Path) -> None:
    out = tmp_path / "prompts" / "swe.jsonl"
    done = subprocess.run([sys.executable, str(GENERATOR), "--out", str(out)], capture_output=True, text=True,
                          check=True)
    assert "wrote 63 rows" in done.stdout
    assert out.read_bytes() == (REPO / "examples" / "prompts" / "swe.jsonl").read_bytes()


def test_a_bad_scenario_file_is_named_with_what_is_wrong(tmp_path: Path) -> None:
    data = tmp_path / "demo_prompts"
    shutil.copytree(REPO / "hack" / "demo_prompts", data)
    broken = data / "scenarios" / "08-go-concurrent-map.yaml"
    broken.write_text(broken.read_text().replace("lang: Go\n", "lang: Golang\n", 1))
    generator = _generator()
    with pytest.raises(SystemExit, match=r"08-go-concurrent-map.yaml: lang 'Golang' is not one of"):
        generator.load_data(data)
    broken.write_text(broken.read_text().replace("test_cmd:", "test_command:", 1))
    with pytest.raises(SystemExit, match=r"(?s)08-go-concurrent-map.yaml: .*test_cmd\n  Field required.*test_command"):
        generator.load_data(data)


def test_the_conversation_generator_reproduces_the_committed_conversations(tmp_path: Path) -> None:
    out = tmp_path / "conversations.jsonl"
    done = subprocess.run([sys.executable, str(REPO / "hack" / "make_demo_conversations.py"), "--out", str(out)],
                          capture_output=True, text=True, check=True)
    assert "wrote 48 rows" in done.stdout
    assert out.read_bytes() == (REPO / "examples" / "prompts" / "conversations.jsonl").read_bytes()
