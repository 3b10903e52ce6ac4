"""Each image gets only its own code and libraries: the role distributions (runner/, runner/sim/, operator/) built
into wheels here, offline, and their install sets worked out from the metadata of what this environment holds.

The root pyproject.toml is the all-in-one development distribution; its lists must stay those of the roles.
"""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
ROLES = {"runner": REPO / "runner", "sim": REPO / "runner" / "sim", "operator": REPO / "operator"}
PACKAGES = {"runner": "tokenmill_runner", "sim": "tokenmill_sim", "operator": "tokenmill_operator"}
DEMO_SPEC = REPO / "examples" / "demo.yaml"


def _project(path: Path) -> dict:
    return tomllib.loads((path / "pyproject.toml").read_text())["project"]


def _names(requirements: Iterable[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


# ----------------------------------------------------------------------------------------------------------------
# The root (development) distribution mirrors the roles.


def test_the_root_lists_are_the_roles_lists() -> None:
    root, runner, sim, operator = (_project(REPO), _project(ROLES["runner"]), _project(ROLES["sim"]),
                                   _project(ROLES["operator"]))
    extras = root["optional-dependencies"]
    assert root["dependencies"] == runner["dependencies"]
    for role, project in (("sim", sim), ("operator", operator)):  # both build on the runner
        own = [r for r in project["dependencies"] if canonicalize_name(Requirement(r).name) != "tokenmill-runner"]
        assert set(extras[role]) == set(own) - set(runner["dependencies"]), role
    assert set(extras["sim"]) | set(extras["operator"]) <= set(extras["test"]), "make install must pull all"
    assert root["scripts"] == {**runner["scripts"], **operator["scripts"]}
    commands = {**sim["entry-points"]["tokenmill.commands"], **operator["entry-points"]["tokenmill.commands"]}
    assert root["entry-points"]["tokenmill.commands"] == commands
    assert {p["version"] for p in (root, runner, sim, operator)} == {root["version"]}
    assert f"tokenmill-runner=={runner['version']}" in operator["dependencies"]
    assert f"tokenmill-runner=={runner['version']}" in sim["dependencies"]


# ----------------------------------------------------------------------------------------------------------------
# The role wheels.


class Wheel:
    def __init__(self, path: Path) -> None:
        self.path = path
        with zipfile.ZipFile(path) as archive:
            self.files = archive.namelist()
            info = next(name.split("/")[0] for name in self.files if name.endswith(".dist-info/METADATA"))
            self.metadata = email.parser.Parser().parsestr(archive.read(f"{info}/METADATA").decode())
            entry_points = f"{info}/entry_points.txt"
            self.entry_points = archive.read(entry_points).decode() if entry_points in self.files else ""

    @property
    def top_level(self) -> set[str]:
        return {name.split("/")[0] for name in self.files if not name.split("/")[0].endswith(".dist-info")}

    @property
    def requires(self) -> list[str]:
        return self.metadata.get_all("Requires-Dist") or []


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Wheel]:
    """Build each role from a copy of its folder (setuptools writes build/ and *.egg-info next to the sources)."""
    out = tmp_path_factory.mktemp("wheels")
    built = {}
    for role, folder in ROLES.items():
        source = tmp_path_factory.mktemp(role)
        shutil.copy(folder / "pyproject.toml", source)
        shutil.copytree(folder / PACKAGES[role], source / PACKAGES[role],
                        ignore=shutil.ignore_patterns("__pycache__"))
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index",
                        "--no-build-isolation", "--wheel-dir", str(out / role), str(source)], check=True)
        (path,) = (out / role).glob("*.whl")
        built[role] = Wheel(path)
    return built


def _wanted(requirement: Requirement, extras: set[str]) -> bool:
    return requirement.marker is None or any(requirement.marker.evaluate({"extra": e}) for e in extras | {""})


def install_set(wheel: Wheel, local: dict[str, Wheel]) -> set[str]:
    """Every distribution `pip install` of this wheel brings, from the metadata installed here (the development
    environment holds every role's dependencies); other role wheels stand for themselves."""
    found: set[str] = set()
    todo = [(Requirement(r), set()) for r in wheel.requires if _wanted(Requirement(r), set())]
    while todo:
        requirement, _ = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in found:
            continue
        found.add(name)
        if name in local:
            requires = local[name].requires
        else:
            try:
                requires = distribution(name).requires or []
            except PackageNotFoundError:
                pytest.fail(f"{wheel.path.name} needs {name}, which this environment lacks: run make install")
        todo += [(Requirement(r), set()) for r in requires if _wanted(Requirement(r), set(requirement.extras))]
    return found


def test_each_wheel_holds_only_its_own_package(wheels: dict[str, Wheel]) -> None:
    for role, wheel in wheels.items():
        assert wheel.top_level == {PACKAGES[role]}, f"{role}: {sorted(wheel.top_level)}"
    assert "tokenmill = tokenmill_runner.cli:main" in wheels["runner"].entry_points
    assert "tokenmill-operator = tokenmill_operator.main:main" in wheels["operator"].entry_points
    assert "plan = tokenmill_operator.plan_cli:register" in wheels["operator"].entry_points
    assert "sim-server = tokenmill_sim.cli:register" in wheels["sim"].entry_points
    # Every source file of a package is in its wheel, the operator's layer folders (observe, decide, act) included.
    for role, folder in ROLES.items():
        sources = {path.relative_to(folder).as_posix() for path in (folder / PACKAGES[role]).rglob("*.py")}
        assert sources <= set(wheels[role].files), f"{role}: missing {sorted(sources - set(wheels[role].files))}"


def test_the_runner_wheel_carries_the_sglang_release_facts(runner_alone: dict[str, str]) -> None:
    # The spec's default image and the planner's release checks read data/sglang_architectures.json.
    probe = _python(runner_alone, "-c", "from tokenmill_runner.facts.releases import release; "
                    "print(release('0.5.23').serves('KimiK25ForConditionalGeneration'))")
    assert probe.returncode == 0 and probe.stdout.strip() == "True", probe.stderr


def test_the_runner_image_has_no_operator_simulator_or_cluster_libraries(wheels: dict[str, Wheel]) -> None:
    local = {"tokenmill-runner": wheels["runner"]}
    runner = install_set(wheels["runner"], local)
    assert {"httpx", "pyarrow", "boto3", "transformers"} <= runner
    assert not runner & {"kopf", "kubernetes", "aiohttp", "tokenmill-operator", "tokenmill-sim"}, sorted(runner)


def test_the_operator_image_has_the_runner_but_not_the_simulator(wheels: dict[str, Wheel]) -> None:
    operator = install_set(wheels["operator"], {"tokenmill-runner": wheels["runner"]})
    assert {"tokenmill-runner", "kopf", "kubernetes"} <= operator
    assert "tokenmill-sim" not in operator


def test_the_simulator_brings_its_server_and_nothing_of_the_cluster(wheels: dict[str, Wheel]) -> None:
    sim = install_set(wheels["sim"], {"tokenmill-runner": wheels["runner"]})
    assert {"aiohttp", "tokenmill-runner"} <= sim  # it loads tokenizers with the runner's loader
    assert not sim & {"kopf", "kubernetes", "tokenmill-operator"}, sorted(sim)


# ----------------------------------------------------------------------------------------------------------------
# The runner wheel alone, as in its image.


@pytest.fixture(scope="module")
def runner_alone(wheels: dict[str, Wheel], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An environment with the runner wheel and the third-party libraries of this one, but not the development
    distribution (neither its import finder nor its entry points), so tokenmill_sim and tokenmill_operator are
    absent as they are in the runner image."""
    target = tmp_path_factory.mktemp("runner-target")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target",
                    str(target), str(wheels["runner"].path)], check=True)
    libraries = tmp_path_factory.mktemp("libraries")
    site_packages = Path(next(p for p in sys.path if p.endswith("site-packages")))
    for entry in site_packages.iterdir():
        if entry.name.startswith(("tokenmill", "__editable__")) or entry.suffix == ".pth":
            continue
        (libraries / entry.name).symlink_to(entry)
    return {**os.environ, "PYTHONPATH": f"{target}{os.pathsep}{libraries}", "PYTHONNOUSERSITE": "1"}


def _python(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    # Not from the repository root: its tokenmill.egg-info (from `make install`) would show the dev entry points.
    return subprocess.run([sys.executable, "-S", *args], env=env, cwd=env["PYTHONPATH"].split(os.pathsep)[0],
                          capture_output=True, text=True, timeout=120)


def _runner_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return _python(env, "-c", "import sys; from tokenmill_runner.cli import main; sys.exit(main(sys.argv[1:]))", *args)


def test_without_the_simulator_the_runner_says_what_to_install(runner_alone: dict[str, str], tmp_path) -> None:
    assert _python(runner_alone, "-c", "import tokenmill_sim").returncode != 0, "the simulator must be absent here"
    sim = _runner_cli(runner_alone, "sim-server", "--model-path", str(REPO / "examples" / "demo-model"))
    assert sim.returncode == 1 and "install tokenmill[sim]" in sim.stderr, sim.stderr
    run = _runner_cli(runner_alone, "-q", "run", str(DEMO_SPEC), "--out", str(tmp_path / "out"))
    assert run.returncode == 1, run.stderr
    assert "starts the built-in SGLang simulator" in run.stderr and "pass --server URL" in run.stderr, run.stderr
    listed = [line.split()[0] for line in _runner_cli(runner_alone, "--help").stdout.splitlines()
              if line.startswith("    ") and line.split()]
    assert {"run", "report", "inspect", "sim-server"} <= set(listed) and "plan" not in listed, listed
