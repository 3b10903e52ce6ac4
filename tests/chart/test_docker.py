"""The Dockerfiles, without building them (no container runtime here): what can be checked statically."""

from __future__ import annotations

import re
import tomllib

import pytest
import yaml

from tokenmill_operator.decide import manifests

from .tools import CHART, REPO

DOCKER = REPO / "docker"
IMAGES = {"operator": ("tokenmill-operator", {"8080", "8081"}), "runner": ("tokenmill", {"9400"})}
# What each image's build context holds and installs: its role's distribution (and the runner's, which the operator
# imports), never the simulator (runner/sim/) or the development distribution at the root.
CONTEXT = {"operator": ["!runner/pyproject.toml", "!runner/tokenmill_runner/", "!operator/"],
           "runner": ["!runner/pyproject.toml", "!runner/tokenmill_runner/"]}
INSTALLED = {"operator": "./runner ./operator", "runner": "./runner"}


def _instructions(name: str) -> list[tuple[str, str]]:
    text = (DOCKER / f"Dockerfile.{name}").read_text()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_dockerfile(name: str) -> None:
    entrypoint, ports = IMAGES[name]
    steps = _instructions(name)
    args = {k: v for k, v in (s[1].split("=", 1) for s in steps if s[0] == "ARG" and "=" in s[1])}
    # Pinned base: a full x.y.z version tag (a digest may be added by --build-arg), never latest.
    base = args["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", base), base
    froms = [v for k, v in steps if k == "FROM"]
    assert len(froms) == 2 and all(f.startswith("${PYTHON_IMAGE}") for f in froms), "two stages on the pinned base"
    # Non-root, numeric (runAsNonRoot can verify it), the UID the chart and the operator's runner pods use.
    users = [v for k, v in steps if k == "USER"]
    assert users and users[-1] == "10001:10001"
    assert manifests.RUNNER_UID == 10001
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == 10001
    # The entrypoint is the console script of pyproject.toml, and of the role's own distribution.
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert entrypoint in scripts
    role_scripts = tomllib.loads((REPO / name / "pyproject.toml").read_text())["project"]["scripts"]
    assert entrypoint in role_scripts
    (ep,) = [v for k, v in steps if k == "ENTRYPOINT"]
    assert ep == f'["{entrypoint}"]'
    exposed = {p for k, v in steps if k == "EXPOSE" for p in v.split()}
    assert exposed == ports
    # Small: wheels only, no pip cache, and the final stage copies just the virtual environment.
    assert any(k == "RUN" and "--only-binary=:all:" in v for k, v in steps)
    assert any(k == "RUN" and f"pip install --only-binary=:all: {INSTALLED[name]} " in v for k, v in steps)
    assert "PIP_NO_CACHE_DIR=1" in " ".join(v for k, v in steps if k == "ENV")
    final = steps[[i for i, (k, _) in enumerate(steps) if k == "FROM"][-1]:]
    assert [v for k, v in final if k == "COPY"] == ["--from=build /opt/tokenmill /opt/tokenmill"]
    # Everything written goes to /tmp (the read-only root filesystem).
    assert "HOME=/tmp" in " ".join(v for k, v in final if k == "ENV")
    ignore = [line for line in (DOCKER / f"Dockerfile.{name}.dockerignore").read_text().splitlines()
              if line and not line.startswith("#")]
    allowed = [line for line in ignore[ignore.index("*") + 1:] if line.startswith("!")]
    assert allowed == CONTEXT[name]


def test_ports_match_the_chart_and_the_operator() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert {str(values["operator"]["healthPort"]), str(values["operator"]["metricsPort"])} == IMAGES["operator"][1]
    assert {str(manifests.RUNNER_METRICS_PORT)} == IMAGES["runner"][1]
