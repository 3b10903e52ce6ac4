"""A multi-turn dataset with tool calls (mode all-turns) through the operator: kubectl apply → planned server →
runner Job whose pods (played by the real runner, operator_kit.py) regenerate the demo's conversations turn by turn
→ Succeeded, every conversation committed exactly once with its turns and why it ended."""

from __future__ import annotations

from collections import Counter

import orjson
import pytest

from tokenmill_runner.generate.conversation import STOP_REASONS
from tokenmill_runner.store.shards import read_committed_rows
from tokenmill_runner.store.storage import open_storage, s3_client

from .conftest import REPO
from .operator_kit import (  # noqa: F401  (fixtures)
    b5_resource,
    condition,
    crd,
    credentials,
    operator,
    play_runner_pods,
    s3_world,
    simulator_for,
    wait_phase,
)

pytestmark = pytest.mark.e2e

CONVERSATIONS = REPO / "examples" / "prompts" / "conversations.jsonl"
DATASET = "M1_tool_conversations"


def test_tool_conversations_regenerate_turn_by_turn_to_succeeded(cluster, namespace, operator, credentials,
                                                                 s3_world, tmp_path):
    s3_client(s3_world).put_object(Bucket="tokenmill-data", Key="prompts/conversations.jsonl",
                                   Body=CONVERSATIONS.read_bytes())
    cluster.apply(b5_resource(namespace, s3_world, datasets=[{
        "name": DATASET, "source": "s3://tokenmill-data/prompts/conversations.jsonl", "mode": "all-turns",
        "sampling": {"maxNewTokens": 10240}}]))
    wait_phase(cluster, namespace, "Generating")
    with simulator_for(cluster, namespace) as simulator:
        play_runner_pods(cluster, namespace, simulator.url, tmp_path, count=4)

    done = wait_phase(cluster, namespace, "Succeeded", timeout=120)
    expected = {orjson.loads(line)["sample_id"] for line in CONVERSATIONS.read_bytes().splitlines()}
    status = done["status"]
    assert condition(done, "Succeeded")["status"] == "True"
    assert status["progress"]["completed"] == len(expected) and status["progress"]["failed"] == 0
    storage = open_storage(f"s3://tokenmill-data/runs/{namespace}/", s3_world)
    rows = list(read_committed_rows(storage, DATASET))
    assert Counter(row["sample_id"] for row in rows) == Counter(expected), "each conversation exactly once"
    reasons = Counter(row["stop_reason"] for row in rows)
    assert set(reasons) <= set(STOP_REASONS) and reasons["complete"] > 0, reasons
    assert sum(row["turn_count"] for row in rows) > len(rows), "conversations of several turns"
    assert all(len(row["turns"]) == row["turn_count"] for row in rows)
    report = orjson.loads(storage.get("report/report.json"))["datasets"][DATASET]
    assert report["conversations"]["count"] == len(expected)
    assert report["conversations"]["stop_reasons"] == dict(sorted(reasons.items()))
