"""The reconcile pass's pure parts: planning on a spec edit (a plan the spec cannot have is an error; model files that
cannot be read are not), and which runs need no pass at all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill_operator.decide.facts import Context
from tokenmill_operator.decide.status import DatasetGenerationStatus
from tokenmill_operator.reconcile import plan_for
from tokenmill_runner.spec.resource import parse_document
from tokenmill_runner.store.storage import open_storage

from .test_lifecycle import PLAN

KIMI = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "kimi-k2.5.json"


def context(model: str, generation: int, previous: DatasetGenerationStatus | None = None,
            endpoint: str | None = None) -> Context:
    document = {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "r"},
                "spec": {"model": {"path": model, "weightBytes": 594 * 10**9},
                         "server": {"gpuProduct": "NVIDIA-H200"},
                         "datasets": [{"name": "a", "source": "s3://p/a.jsonl"}],
                         "output": {"uri": "s3://o/", **({"endpoint": endpoint} if endpoint else {})}}}
    return Context(body=document, name="r", namespace="ns", generation=generation,
                   spec=parse_document(document).spec, previous=previous or DatasetGenerationStatus())


class ModelFiles:
    """The model's prefix on the S3 server: where the operator reads config.json."""

    def __init__(self, endpoint: str, bucket: str) -> None:
        self.endpoint, self.uri = endpoint, f"s3://{bucket}/kimi/"
        self.storage = open_storage(self.uri, endpoint)

    def context(self, generation: int, previous: DatasetGenerationStatus | None = None) -> Context:
        return context(self.uri, generation, previous, self.endpoint)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(json.loads(KIMI.read_text())["config"]))
    return tmp_path


@pytest.fixture
def model_files(s3_endpoint: str, s3_bucket: str) -> ModelFiles:
    files = ModelFiles(s3_endpoint, s3_bucket)
    files.storage.put("config.json", json.dumps(json.loads(KIMI.read_text())["config"]).encode())
    return files


def test_a_plan_is_made_once_per_generation(model_files: ModelFiles):
    made = plan_for(model_files.context(2), None)
    assert made.plan is not None and made.generation == 2 and made.error is None
    model_files.storage.delete("config.json")  # not read again for the same generation
    previous = DatasetGenerationStatus(server_plan=made.plan, planned_generation=2, observed_generation=2)
    kept = plan_for(model_files.context(2, previous), None)
    assert kept.plan == made.plan and kept.generation is None


def test_unreadable_model_files_on_a_spec_edit_keep_the_previous_plan_and_say_so(model_files: ModelFiles):
    model_files.storage.delete("config.json")
    previous = DatasetGenerationStatus(server_plan=PLAN, planned_generation=2, observed_generation=2)
    planning = plan_for(model_files.context(3, previous), None)
    assert planning.plan is None and planning.error is None, "not a plan error: nothing terminal"
    assert "cannot read the model files to plan the server for generation 3" in planning.transient
    assert "config.json" in planning.transient
    assert "the server keeps the plan of generation 2" in planning.transient


def test_a_config_the_planner_cannot_use_is_a_plan_error(model_files: ModelFiles):
    model_files.storage.put("config.json", b"{not json")
    planning = plan_for(model_files.context(1), None)
    assert planning.plan is None and planning.transient is None and planning.error


@pytest.mark.parametrize("path", ["/etc", "/nonexistent-dir", "/proc/self", "{model_dir}"])
def test_a_local_model_path_tells_nothing_about_the_operators_filesystem(model_dir: Path, path: str):
    # security-a87e82b.md W10: on a87e82b the operator called os.path.isdir on a tenant's path, and the status
    # differed for a folder that exists, one that does not and one holding a config.json.
    planning = plan_for(context(path.format(model_dir=model_dir), 1), None)
    assert planning.plan is None and planning.error is not None
    assert planning.error.startswith("the operator reads config.json only from S3, and neither spec.model.path (")
    assert "does not exist" not in planning.error and "index" not in planning.error


def test_a_succeeded_run_is_settled_until_its_spec_or_a_new_retry_request_changes():
    from tokenmill_operator.decide.status import RetryStatus
    from tokenmill_operator.reconcile import settled

    done = DatasetGenerationStatus(phase="Succeeded", observed_generation=4,
                                   retry=RetryStatus(handled="1", at="2026-11-29T12:00:00Z"))

    def body(generation: int, retry: str | None = None) -> dict:
        annotations = {"tokenmill.io/retry-failed": retry} if retry else {}
        return {"metadata": {"generation": generation, "annotations": annotations}}

    assert settled(body(4), done) and settled(body(4, "1"), done)
    assert not settled(body(5), done), "a spec edit is looked at"
    assert not settled(body(4, "2"), done), "a new retry request is answered"
    assert not settled(body(4), done.model_copy(update={"phase": "Failed"})), "failed runs stay watched"


class SharingKube:
    """Answers create/get/patch from a dict, as the API server would for the shared cache's objects."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict] = {}

    def create_if_absent(self, manifest: dict) -> bool:
        key = (manifest["kind"], manifest["metadata"]["name"])
        if key in self.objects:
            return False
        self.objects[key] = json.loads(json.dumps(manifest))
        return True

    def get(self, api_version: str, kind: str, name: str, namespace: str) -> dict | None:
        return self.objects.get((kind, name))

    def patch(self, api_version: str, kind: str, name: str, namespace: str, body: dict) -> None:
        self.objects[(kind, name)]["metadata"].update(body["metadata"])


def test_the_shared_cache_is_owned_by_every_run_serving_the_model():
    # security-a87e82b.md W8: on a87e82b the claim and its fill Job had no owner and were never deleted.
    from tokenmill_operator.act.children import ensure_shared_cache
    from tokenmill_operator.decide.settings import OperatorSettings

    def run(name: str, uid: str) -> Context:
        document = {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration",
                    "metadata": {"name": name, "uid": uid},
                    "spec": {"model": {"path": "s3://models/kimi/", "cache": {"mode": "sharedVolume"}},
                             "datasets": [{"name": "a", "source": "s3://p/a.jsonl"}],
                             "output": {"uri": f"s3://o/{name}/", "credentialsSecret": "s3"}}}
        return Context(body=document, name=name, namespace="team-a", generation=1,
                       spec=parse_document(document).spec, previous=DatasetGenerationStatus())

    kube = SharingKube()
    for name, uid in (("first", "u-1"), ("second", "u-2"), ("first", "u-1")):
        ensure_shared_cache(kube, run(name, uid), PLAN, OperatorSettings())  # type: ignore[arg-type]
    assert {kind for kind, _ in kube.objects} == {"PersistentVolumeClaim", "Job"}
    for obj in kube.objects.values():
        owners = obj["metadata"]["ownerReferences"]
        assert [(o["name"], o["uid"]) for o in owners] == [("first", "u-1"), ("second", "u-2")], obj["kind"]
        assert not any(o["controller"] or o["blockOwnerDeletion"] for o in owners)


def test_a_plan_starts_from_the_clusters_measured_constants_read_from_the_operators_configmap(
        model_files: ModelFiles):
    from tokenmill_operator.decide.planner.verify import constants_entry
    from tokenmill_runner.facts.refit import Refit

    published = plan_for(model_files.context(1), None)
    assert published.plan is not None and published.plan.measured_constants is None
    key = "NVIDIA-H200.nvlink.0.5.23.KimiK25ForConditionalGeneration"
    slow = Refit(0.7, 3.0, 1.0, samples=40, error_before=0.3, error_after=0.01, fitted=("experts", "collectives"))
    measured = plan_for(model_files.context(1), None, measured=lambda: {key: constants_entry(slow)})
    assert measured.plan is not None and measured.plan.measured_constants == key
    assert measured.plan.prediction.eta_seconds > published.plan.prediction.eta_seconds
    # Entries of other hardware are not this plan's.
    other = plan_for(model_files.context(1), None, measured=lambda: {"NVIDIA-H100.nvlink.x.y": constants_entry(slow)})
    assert other.plan.measured_constants is None


def test_a_checked_plan_keeps_its_refitted_constants_and_says_whether_another_layout_wins(model_files: ModelFiles):
    from datetime import UTC, datetime

    from tokenmill_operator.decide.facts import Decision
    from tokenmill_operator.decide.planner import model_facts, plan_step_model
    from tokenmill_operator.decide.planner.verify import CONFIGMAP_NAME, read_constants
    from tokenmill_operator.decide.server_metrics import WindowFacts
    from tokenmill_operator.decide.settings import OperatorSettings
    from tokenmill_operator.decide.status import VerificationStatus
    from tokenmill_operator.reconcile import _record_constants
    from tokenmill_runner.facts.refit import Refit, StepSample
    from tokenmill_runner.facts.throughput import CALIBRATION

    from .test_measured_constants import ConfigMaps

    context_ = model_files.context(2)
    plan = plan_for(context_, None).plan
    data = json.loads(KIMI.read_text())
    facts = model_facts(data["config"], 594 * 10**9)
    truth = Refit(1.2, 2.0, 1.0, samples=0, error_before=0, error_after=0, fitted=())
    step = plan_step_model(context_.spec, facts, calibration=truth.calibration(CALIBRATION))
    samples = tuple(StepSample(b, 3000, step.step_seconds(b, 3000)) for b in (1, 4, 16, 32, 64, 128, 256))
    now = datetime(2026, 12, 2, 7, 0, tzinfo=UTC)
    checked = VerificationStatus(verified=False, predicted_batch=1, observed_batch=1, predicted_step_milliseconds="1",
                                 observed_step_milliseconds="1", samples=7, window_seconds=600, at="t",
                                 planned_generation=2)
    decision = Decision(DatasetGenerationStatus(phase="Generating", server_plan=plan, verification=checked),
                        server_replicas=1)
    kube = ConfigMaps()
    after = _record_constants(kube, context_, None, decision, WindowFacts(now, samples, 0, 0.0),
                              OperatorSettings(operator_namespace="tokenmill-system"))
    stored = kube.objects[("tokenmill-system", CONFIGMAP_NAME)]["data"]
    (key,) = stored
    assert key == f"NVIDIA-H200.{plan.interconnect}.{plan.sglang_version}.KimiK25ForConditionalGeneration"
    assert read_constants(stored, key).collective_scale == pytest.approx(2.0, rel=0.1)
    measured = [e for e in after.events if e.reason == "ConstantsMeasured"]
    assert len(measured) == 1 and f"ConfigMap tokenmill-system/{CONFIGMAP_NAME}" in measured[0].message
    replan = next(c for c in after.status.conditions if c.type == "ReplanSuggested")
    assert replan.reason in ("FasterLayoutMeasured", "CurrentLayoutFastest") and "h" in replan.message
    # replan: off keeps the constants and suggests nothing; no operator namespace: nothing is written at all.
    off = context_.spec.model_copy(update={"server": context_.spec.server.model_copy(update={"replan": "off"})})
    quiet = _record_constants(ConfigMaps(), Context(**{**context_.__dict__, "spec": off}), None, decision,
                              WindowFacts(now, samples, 0, 0.0), OperatorSettings(operator_namespace="ops"))
    assert not any(c.type == "ReplanSuggested" for c in quiet.status.conditions)
    nowhere = ConfigMaps()
    assert _record_constants(nowhere, context_, None, decision, WindowFacts(now, samples, 0, 0.0),
                             OperatorSettings(operator_namespace=None)) is decision and not nowhere.objects


def test_speculators_layout_on_a_target_that_cannot_serve_it_is_a_plan_error(model_files: ModelFiles):
    # speculators' final state is the pre-norm residual; only gpt_oss's final norm takes a capture hook in 0.5.23
    # (models/gpt_oss.py:711-738), so the operator refuses the layout for Kimi-K2.5 from its config.json before any
    # GPU hour (tests/unit/test_speculators_layout.py has the architecture rules).
    base = model_files.context(1)
    states = {"layouts": ["speculators"], "layerIds": [1, 29, 57, 60]}
    document = {**base.body, "spec": {**base.body["spec"], "hiddenStates": states}}
    refused = plan_for(Context(body=document, name="r", namespace="ns", generation=1,
                               spec=parse_document(document).spec, previous=DatasetGenerationStatus()), None)
    assert refused.plan is None and refused.transient is None
    assert refused.error and "spec.hiddenStates.layouts 'speculators'" in refused.error
    assert "KimiK25ForConditionalGeneration" in refused.error
