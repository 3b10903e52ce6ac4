"""What the server's image and probes assume, against every supported release's wheel (sglang_wheels.py): the CUDA
line a plain vX image is built for (the wheel's cuda-python pin, which the image's CUDA must satisfy) decides the
driver the plan asks for, and the health probes wait out the release's own health-check timeout."""

from __future__ import annotations

import ast
import re
import zipfile

import pytest

from tokenmill_operator.decide.manifests import HEALTH_PROBE_TIMEOUT_S
from tokenmill_runner.facts.releases import (
    HEALTH_CHECK_TIMEOUT_S,
    MIN_DRIVER_BY_CUDA_MAJOR,
    SUPPORTED_RELEASES,
    release,
)

from .sglang_wheels import tree, wheel

CUDA_PYTHON = re.compile(r"^Requires-Dist: cuda-python\s*(==|>=)\s*(\d+)\.", re.MULTILINE)


def metadata(version: str) -> str:
    with zipfile.ZipFile(wheel(version)) as archive:
        return archive.read(f"sglang-{version}.dist-info/METADATA").decode()


@pytest.mark.parametrize("version", SUPPORTED_RELEASES)
def test_the_plain_image_runs_the_cuda_line_the_wheel_pins(version: str) -> None:
    pin = CUDA_PYTHON.search(metadata(version))
    assert pin, f"SGLang {version}: no cuda-python pin in METADATA"
    facts = release(version)
    assert int(facts.default_cuda.split(".")[0]) == int(pin.group(2))
    assert int(facts.image_cuda(facts.image).split(".")[0]) in MIN_DRIVER_BY_CUDA_MAJOR  # type: ignore[union-attr]


@pytest.mark.parametrize("version", SUPPORTED_RELEASES)
def test_the_probes_outwait_the_release_health_check(version: str) -> None:
    module = tree(version, "sglang/srt/entrypoints/http_server.py")
    assert module is not None
    # HEALTH_CHECK_TIMEOUT = int(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", 20))
    default = next(ast.literal_eval(node.value.args[0].args[1]) for node in module.body
                   if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                   and node.targets[0].id == "HEALTH_CHECK_TIMEOUT")
    assert default == HEALTH_CHECK_TIMEOUT_S < HEALTH_PROBE_TIMEOUT_S
