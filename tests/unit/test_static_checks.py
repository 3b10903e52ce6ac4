"""The static checks of `make test` (docs/development.md): ruff and mypy find nothing in the tree, and they do fail
on a new finding, each planted in a temporary copy of the tree (an unused import, an import out of order, a loop
variable caught by a closure, an unannotated function in a pure module, a wrong type in an edge module)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CONFIG = tomllib.loads((REPO / "pyproject.toml").read_text())
# What the copies need: the three packages, the tests, the scripts and the configuration both tools read.
TREE = ["pyproject.toml", "runner", "operator", "tests", "hack"]


def ruff(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "ruff"), "check", "--no-cache", "."], cwd=root, capture_output=True, text=True,
                          timeout=300)


def mypy(root: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "mypy"), "--cache-dir", str(cache)], cwd=root, capture_output=True, text=True,
                          timeout=900)


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    ignore = shutil.ignore_patterns("__pycache__", ".mypy_cache", ".ruff_cache", "*.egg-info")
    for name in TREE:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, root / name, ignore=ignore)
        else:
            shutil.copy2(source, root / name)
    return root


def test_ruff_finds_nothing_in_the_tree():
    result = ruff(REPO)
    assert result.returncode == 0, f"ruff findings (docs/development.md says how to fix them):\n{result.stdout}"


def test_mypy_finds_nothing_in_the_tree(tmp_path: Path):
    result = mypy(REPO, REPO / ".mypy_cache")
    assert result.returncode == 0, f"mypy findings (docs/development.md):\n{result.stdout}{result.stderr}"
    assert "Success: no issues found" in result.stdout


def test_every_pure_module_is_checked_strictly():
    pure = next(c for c in CONFIG["tool"]["importlinter"]["contracts"] if c["name"].startswith("Pure modules"))
    strict = next(o for o in CONFIG["tool"]["mypy"]["overrides"] if o.get("disallow_untyped_defs"))
    missing = set(pure["source_modules"]) - set(strict["module"])
    assert not missing, f"pure modules not in mypy's strict list of pyproject.toml: {sorted(missing)}"
    assert {"tokenmill_runner.spec", "tokenmill_runner.spec.*"} <= set(strict["module"])


def test_ruff_fails_on_planted_findings(copy: Path):
    target = copy / "runner" / "tokenmill_runner" / "progress.py"
    original = target.read_text()
    # two unused imports out of order at the top, and a closure over a loop variable at the end
    planted = original.replace("from __future__ import annotations\n",
                               "from __future__ import annotations\n\nimport sys\nimport abc\n", 1) + (
        "\n\ndef _closures() -> list:\n"
        "    made = []\n"
        "    for n in range(3):\n"
        "        made.append(lambda: n)\n"  # every closure sees the last n
        "    return made\n"
    )
    target.write_text(planted)
    try:
        result = ruff(copy)
    finally:
        target.write_text(original)
    assert result.returncode != 0
    for rule in ("F401", "I001", "B023"):
        assert rule in result.stdout, (rule, result.stdout)
    assert ruff(copy).returncode == 0  # the copy itself is clean again: the findings were the planted ones


def test_mypy_fails_on_planted_findings(copy: Path, tmp_path: Path):
    pure = copy / "runner" / "tokenmill_runner" / "progress.py"  # pure: checked strictly
    edge = copy / "runner" / "tokenmill_runner" / "metrics.py"  # an edge: default settings
    originals = {pure: pure.read_text(), edge: edge.read_text()}
    pure.write_text(originals[pure] + "\n\ndef _untyped(value):\n    return value\n")
    edge.write_text(originals[edge] + "\n\n_COUNT: int = 'three'\n")
    try:
        result = mypy(copy, tmp_path / "cache")
    finally:
        for path, text in originals.items():
            path.write_text(text)
    assert result.returncode != 0
    assert "progress.py" in result.stdout and "[no-untyped-def]" in result.stdout, result.stdout
    assert "metrics.py" in result.stdout and "[assignment]" in result.stdout, result.stdout
