"""The server image: against the GPU nodes' NVIDIA driver (planner/serving.py server_image), a CUDA 13 image on a
driver older than 580 is swapped for SGLang's -cu129 tag of the same release, or, for the default image, of the last
release that has one, and what no image fixes is refused at plan time with the reason; a tag that names no release
is either stated (sglangVersion) or, when it does not move, planned with the assumed release said; the health
probes wait out SGLang's own health check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill_operator.decide.manifests import server_statefulset
from tokenmill_operator.decide.planner import PlanError, plan_server
from tokenmill_operator.decide.status import DatasetGenerationStatus
from tokenmill_operator.reconcile import plan_for
from tokenmill_runner.facts.releases import DEFAULT_IMAGE, HEALTH_CHECK_TIMEOUT_S, release
from tokenmill_runner.spec.resource import SpecError

from .test_planner import H200, facts, fixture, make_spec
from .test_reconcile import ModelFiles, model_files  # noqa: F401 (a fixture)

KIMI = "kimi-k2.5"


def test_a_cuda13_image_on_a_cuda13_driver_is_kept() -> None:
    plan = plan_server(make_spec({"gpuProduct": H200, "cudaDriverMajor": 580}), facts(KIMI))
    assert (plan.image, plan.sglang_version, plan.cuda_driver_major) == (DEFAULT_IMAGE, "0.5.23", 580)
    assert any("driver 580 (spec.server.cudaDriverMajor) runs it" in line for line in plan.reasoning)


def test_the_default_image_on_a_cuda12_driver_becomes_the_last_cuda12_release() -> None:
    plan = plan_server(make_spec({"gpuProduct": H200, "cudaDriverMajor": 570}), facts(KIMI))
    assert (plan.image, plan.sglang_version) == ("lmsysorg/sglang:v0.5.19-cu129", "0.5.19")
    assert any("the server runs lmsysorg/sglang:v0.5.19-cu129 (CUDA 12.9) instead" in line for line in plan.reasoning)


def test_a_chosen_release_keeps_its_release_on_its_cu129_tag() -> None:
    plan = plan_server(make_spec({"gpuProduct": H200, "image": "lmsysorg/sglang:v0.5.17"}), facts(KIMI),
                       node_driver_major=570)
    assert (plan.image, plan.sglang_version) == ("lmsysorg/sglang:v0.5.17-cu129", "0.5.17")
    assert any("the GPU nodes' label nvidia.com/cuda.driver.major" in line for line in plan.reasoning)


def test_the_spec_field_wins_over_the_node_label() -> None:
    plan = plan_server(make_spec({"gpuProduct": H200, "cudaDriverMajor": 580}), facts(KIMI), node_driver_major=570)
    assert plan.image == DEFAULT_IMAGE


@pytest.mark.parametrize("image", ["lmsysorg/sglang:v0.5.23", "lmsysorg/sglang:v0.5.20"])
def test_a_release_without_a_cuda12_image_is_refused_on_a_cuda12_driver(image: str) -> None:
    with pytest.raises(PlanError, match=r"needs NVIDIA driver 580 or newer, and the GPU nodes run driver 570 .*"
                                        r"v0\.5\.19-cu129 is the last CUDA 12 image"):
        plan_server(make_spec({"gpuProduct": H200, "image": image, "cudaDriverMajor": 570}), facts(KIMI))


def test_a_driver_older_than_cuda12_is_refused_whatever_the_image() -> None:
    with pytest.raises(PlanError, match="runs CUDA 12.9, which needs NVIDIA driver 525 or newer.*upgrade"):
        plan_server(make_spec({"gpuProduct": H200, "image": "lmsysorg/sglang:v0.5.9", "cudaDriverMajor": 470}),
                    facts(KIMI))


def test_cuda12_images_run_on_cuda12_drivers() -> None:
    for image in ("lmsysorg/sglang:v0.5.9", "lmsysorg/sglang:v0.5.19-cu129"):
        plan = plan_server(make_spec({"gpuProduct": H200, "image": image, "cudaDriverMajor": 535}), facts(KIMI))
        assert plan.image == image
    assert release("0.5.19").image_cuda("lmsysorg/sglang:v0.5.19-cu129") == "12.9"


def test_an_unknown_driver_keeps_the_image_and_says_what_it_needs() -> None:
    plan = plan_server(make_spec({"gpuProduct": H200}), facts(KIMI))
    assert plan.image == DEFAULT_IMAGE and plan.cuda_driver_major is None
    assert any("needs NVIDIA driver 580 or newer; the nodes' driver is unknown" in line for line in plan.reasoning)


def test_the_statefulset_runs_the_planned_image() -> None:
    spec = make_spec({"gpuProduct": H200, "cudaDriverMajor": 570})
    plan = plan_server(spec, facts(KIMI))
    sts = server_statefulset("run", "ns", {"apiVersion": "v1", "kind": "X", "name": "run", "uid": "u"}, spec, plan)
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == "lmsysorg/sglang:v0.5.19-cu129"


@pytest.mark.parametrize("image", ["lmsysorg/sglang:latest", "lmsysorg/sglang:latest-runtime",
                                   "lmsysorg/sglang:nightly-dev-20261101", "registry.example/sglang:dev"])
def test_a_moving_tag_needs_the_release_stated(image: str) -> None:
    with pytest.raises(SpecError, match="spec.server: .*image .*: the tag moves to each new SGLang build.* set sglangVersion"):
        make_spec({"gpuProduct": H200, "image": image})
    plan = plan_server(make_spec({"gpuProduct": H200, "image": image, "sglangVersion": "0.5.21"}), facts(KIMI))
    assert (plan.sglang_version, plan.image) == ("0.5.21", image)


def test_a_custom_tag_says_which_release_it_is_taken_for() -> None:
    plan = plan_server(make_spec({"gpuProduct": H200, "image": "registry.example/sglang:team-build"}), facts(KIMI))
    assert plan.sglang_version == "0.5.23"
    assert any(line.startswith("warning: the image registry.example/sglang:team-build names no SGLang release; the "
                               "checks and the plan assume 0.5.23") for line in plan.reasoning)


def test_health_probes_wait_for_sglangs_own_health_verdict() -> None:
    spec = make_spec({"gpuProduct": H200})
    plan = plan_server(spec, facts(KIMI))
    container = server_statefulset("run", "ns", {"apiVersion": "v1", "kind": "X", "name": "run", "uid": "u"}, spec,
                                   plan)["spec"]["template"]["spec"]["containers"][0]
    for probe in ("readinessProbe", "livenessProbe"):
        # SGLang answers 503 after SGLANG_HEALTH_CHECK_TIMEOUT (20 s) without a scheduler answer: the kubelet must
        # wait longer than that, or a slow-but-healthy server reads as a timeout.
        assert container[probe]["timeoutSeconds"] > HEALTH_CHECK_TIMEOUT_S == 20
        assert container[probe]["periodSeconds"] >= container[probe]["timeoutSeconds"]


def test_the_operator_reads_the_nodes_driver_only_when_it_makes_a_plan(model_files: ModelFiles) -> None:
    files = model_files  # the operator plans from storage, never from its own filesystem
    reads: list[int] = []

    def node_driver() -> int:
        reads.append(570)
        return 570

    made = plan_for(files.context(1), None, node_driver)
    assert made.plan is not None and made.plan.image == "lmsysorg/sglang:v0.5.19-cu129" and reads == [570]
    previous = DatasetGenerationStatus(server_plan=made.plan, planned_generation=1, observed_generation=1)
    assert plan_for(files.context(1, previous), None, node_driver).plan == made.plan
    assert reads == [570], "a kept plan reads no nodes"
