"""SpecForge's offline layout through the operator on the real control plane: `hiddenStates.layouts: [specforge]`
is planned, the server starts with aux capture and the runner Job generates every sample and captures its aux
layers; once that Job settled every sample, the operator relaunches the server with --enable-return-hidden-states
alone (0.5.23 serves the final state only so) and replaces the Job with one for the final pass, which generates
nothing and captures the final states; then the report, Succeeded, every sample once with both kinds aligned to
its tokens.

Under kwok no container runs: the test plays the server from the StatefulSet's own flags (the simulator started
with the capture flags the operator wrote, so a server built with the wrong flags serves the wrong kind and the
runner refuses it) and the runner pods (operator_kit.play_runner_pods)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from tokenmill_runner.store.hidden_states import AUX, FINAL, read_states, state_markers
from tokenmill_runner.store.shards import read_committed_rows
from tokenmill_runner.store.storage import open_storage, s3_client

from ..integration.test_hidden_states import HIDDEN, LAYERS, expected
from .conftest import REPO
from .operator_kit import (  # noqa: F401  (fixtures)
    NAME,
    b5_resource,
    condition,
    crd,
    credentials,
    dsgen,
    expected_ids,
    operator,
    play_runner_pods,
    runner_pods,
    s3_world,
    simulator_for,
    wait_phase,
)

pytestmark = pytest.mark.e2e

DEMO_PREFIX = "demo/llama-tiny/"  # the simulator's own model (examples/demo-model): its hidden size and layers
DATASET = "B5_openthoughts"
FINAL_KEY = [-1]  # tokenmill_sim.hidden_states.FINAL_LAYER_KEY
AUX_FLAG, FINAL_FLAG = "--enable-return-aux-hidden-states", "--enable-return-hidden-states"


def _demo_model(endpoint: str) -> None:
    s3 = s3_client(endpoint)
    demo = REPO / "examples" / "demo-model"
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        s3.put_object(Bucket="models", Key=DEMO_PREFIX + name, Body=(demo / name).read_bytes())
    s3.put_object(Bucket="models", Key=DEMO_PREFIX + "model.safetensors.index.json",
                  Body=json.dumps({"metadata": {"total_size": 60_000_000}}).encode())


def _server_args(cluster, namespace: str) -> list[str]:
    sts = cluster.apps.read_namespaced_stateful_set(f"{NAME}-server", namespace)
    return list(sts.spec.template.spec.containers[0].args)


def _served_flags(args: list[str]) -> dict[str, bool]:
    """The simulator's capture settings from the server's launch flags, as SGLang would read them."""
    return {"enable_return_aux_hidden_states": AUX_FLAG in args, "enable_return_hidden_states": FINAL_FLAG in args}


def _held_pass(cluster, namespace: str) -> str:
    def one_pass():
        kinds = {pod.spec.containers[0].args[pod.spec.containers[0].args.index("--states-pass") + 1]
                 for pod in runner_pods(cluster, namespace)
                 if pod.status.phase == "Running" and pod.metadata.deletion_timestamp is None}
        return kinds.pop() if len(kinds) == 1 else None

    return cluster.wait_for(one_pass, "runner pods of one states pass", timeout=120)


def test_specforge_s_two_passes_run_through_the_operator_to_succeeded(cluster, namespace, operator, credentials,
                                                                      s3_world, tmp_path):
    _demo_model(s3_world)
    cluster.apply(b5_resource(namespace, s3_world, **{
        "model.path": f"s3://models/{DEMO_PREFIX}", "model.trustRemoteCode": False, "server.replicas": 1,
        "datasets.0.sampling.maxNewTokens": 48, "hiddenStates": {"layouts": ["specforge"]}}))
    wait_phase(cluster, namespace, "Generating")
    first = _server_args(cluster, namespace)
    assert AUX_FLAG in first and FINAL_FLAG not in first
    assert _held_pass(cluster, namespace) == "aux"
    with simulator_for(cluster, namespace, **_served_flags(first)) as simulator:
        play_runner_pods(cluster, namespace, simulator.url, tmp_path / "aux", count=4)

    # The aux Job settled every sample: the server is relaunched for the final state, and a new Job captures it.
    second_pass = cluster.wait_for(lambda: (lambda o: o if ((o.get("status") or {}).get("statesPass") or {})
                                            .get("kind") == "final" else None)(dsgen(cluster, namespace)),
                                   "status.statesPass final", timeout=120)
    assert condition(second_pass, "Succeeded")["status"] != "True"
    assert _held_pass(cluster, namespace) == "final"
    second = _server_args(cluster, namespace)
    assert FINAL_FLAG in second and AUX_FLAG not in second and "--speculative-algorithm" not in second
    events = cluster.core.list_namespaced_event(namespace, field_selector="reason=StatesPass").items
    assert len(events) == 1 and "final states" in events[0].message
    with simulator_for(cluster, namespace, **_served_flags(second)) as simulator:
        play_runner_pods(cluster, namespace, simulator.url, tmp_path / "final", count=4)

    done = wait_phase(cluster, namespace, "Succeeded", timeout=120)
    assert condition(done, "Succeeded")["status"] == "True"
    storage = open_storage(f"s3://tokenmill-data/runs/{namespace}/", s3_world)
    rows = list(read_committed_rows(storage, DATASET))
    assert Counter(row["sample_id"] for row in rows) == Counter(expected_ids()), "each sample once, none again"
    report = json.loads(storage.get("report/report.json"))
    states = report["hidden_states"][DATASET]
    assert states["coverage"] == states["final"]["coverage"] == 1.0
    assert not [f for f in report["findings"] if f["check"].startswith(("hidden_states", "final_states"))]
    by_id = {row["sample_id"]: row for row in rows}
    for kind, layers in ((AUX, LAYERS), (FINAL, FINAL_KEY)):
        markers = list(state_markers(storage, DATASET, kind))
        assert sorted(m["sample_id"] for m in markers) == sorted(by_id)
        for marker in markers[:5]:
            row = by_id[marker["sample_id"]]
            sequence = row["prompt_ids"] + row["output_ids"]
            token_ids, values = read_states(storage, DATASET, marker)
            assert token_ids.tolist() == sequence and values.shape == (len(sequence), len(layers), HIDDEN)
            np.testing.assert_array_equal(values.reshape(len(sequence), -1), expected(sequence, layers))
