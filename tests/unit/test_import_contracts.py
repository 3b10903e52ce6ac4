"""The layering is checked: the import contracts of pyproject.toml ([tool.importlinter]) hold, and they do fail when
the runner imports the operator, a pure module imports an I/O library, `tokenmill plan` pulls in the Kubernetes
client, a cycle appears, a stage imports a stage above it, the operator's decide layer reads through observe, or one
of its layers imports the pass above it (each planted in a copy of the packages)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"tokenmill_runner": REPO / "runner", "tokenmill_sim": REPO / "runner" / "sim",
            "tokenmill_operator": REPO / "operator"}
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
CONTRACTS = [c["name"] for c in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]]
RUNNER, SIM, PURE, PLAN, CYCLES, LAYERS, OPERATOR_LAYERS, OPERATOR_TOP = CONTRACTS


def lint_imports(config: Path, python_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if python_path is not None:
        # Ahead of the development install: the import finder of an editable install comes after sys.path.
        env["PYTHONPATH"] = str(python_path)
    return subprocess.run([str(LINT_IMPORTS), "--config", str(config), "--no-cache"], capture_output=True,
                          text=True, env=env, cwd=config.parent, timeout=120)


def contract_results(output: str) -> dict[str, str]:
    """{contract name: KEPT | BROKEN} from lint-imports' summary (it wraps long names over lines)."""
    flat = re.sub(r"\s+", " ", output)
    results = {}
    for name in CONTRACTS:
        found = re.search(re.escape(re.sub(r"\s+", " ", name)) + r" ?(KEPT|BROKEN)", flat)
        assert found, f"no verdict for {name!r} in:\n{output}"
        results[name] = found.group(1)
    return results


def test_the_import_contracts_hold() -> None:
    done = lint_imports(REPO / "pyproject.toml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert set(contract_results(done.stdout).values()) == {"KEPT"}, done.stdout


def _plant(path: Path, after: str, line: str) -> None:
    text = path.read_text()
    assert after in text, f"{path.name} no longer has {after!r}"
    path.write_text(text.replace(after, after + line, 1))


def test_the_contracts_fail_on_planted_violations(tmp_path: Path) -> None:
    for package, parent in PACKAGES.items():
        shutil.copytree(parent / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    future = "from __future__ import annotations\n"
    runner = tmp_path / "tokenmill_runner"
    _plant(runner / "stats" / "distributions.py", future, "\nfrom tokenmill_operator.decide import names\n")
    _plant(runner / "generate" / "rows.py", future, "\nimport httpx\n")
    _plant(tmp_path / "tokenmill_operator" / "plan_cli.py", future, "\nfrom .kube import Kube\n")
    _plant(runner / "generate" / "results.py", future, "\nfrom . import rows\n")  # rows imports results
    _plant(runner / "store" / "ledger.py", future, "\nfrom ..report import validation\n")  # a stage above store
    operator = tmp_path / "tokenmill_operator"
    _plant(operator / "decide" / "lifecycle.py", future, "\nfrom ..observe import gather\n")  # decide reading
    _plant(operator / "act" / "status.py", future, "\nfrom .. import metrics\n")  # a layer importing the top

    done = lint_imports(tmp_path / "pyproject.toml", python_path=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert contract_results(done.stdout) == {RUNNER: "BROKEN", SIM: "KEPT", PURE: "BROKEN", PLAN: "BROKEN",
                                             CYCLES: "BROKEN", LAYERS: "BROKEN", OPERATOR_LAYERS: "BROKEN",
                                             OPERATOR_TOP: "BROKEN"}, done.stdout
    # Each report names the planted import.
    for planted in ("tokenmill_runner.stats.distributions -> tokenmill_operator.decide.names",
                    "tokenmill_runner.generate.rows -> httpx",
                    "tokenmill_operator.plan_cli -> tokenmill_operator.kube",
                    "tokenmill_runner.generate.results -> tokenmill_runner.generate.rows",
                    "tokenmill_runner.store.ledger -> tokenmill_runner.report.validation",
                    "tokenmill_operator.decide.lifecycle -> tokenmill_operator.observe.gather",
                    "tokenmill_operator.act.status -> tokenmill_operator.metrics"):
        assert planted in done.stdout, planted
