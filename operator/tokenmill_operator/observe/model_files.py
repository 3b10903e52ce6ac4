"""The model's files as the planner needs them: config.json and the weight size, read from an S3 prefix or a local
folder, then handed to the pure planner. A storage edge with no Kubernetes client, so `tokenmill plan` needs no
cluster libraries and the reconcile pass reuses the same reading."""

from __future__ import annotations

import os

import orjson

from tokenmill_runner.facts.workload import Workload
from tokenmill_runner.spec.resource import DatasetGenerationSpec
from tokenmill_runner.store.bounded_get import CONFIG_BYTES, WEIGHT_INDEX_BYTES, get_bounded
from tokenmill_runner.store.storage import StorageRetry, open_storage

from ..decide.constants import Constants, plan_with_constants
from ..decide.planner import ModelFacts, PlanError, ServerPlan, model_facts


def model_files_location(spec: DatasetGenerationSpec, local: bool = True) -> str:
    """Where config.json is readable: the model path if on S3, else the tokenizer's; with `local` (tokenmill plan)
    a local folder too. The operator passes local=False: its answer must not depend on what its own filesystem
    holds, or a tenant's status would tell which of the operator's folders exist (security-a87e82b.md W10)."""
    for location in (spec.model.path, spec.model.tokenizer):
        if location and (location.startswith("s3://") or (local and os.path.isdir(location))):
            return location
    if not local:
        raise PlanError(
            f"the operator reads config.json only from S3, and neither spec.model.path ({spec.model.path!r}) nor "
            "spec.model.tokenizer is an s3:// prefix: give spec.model.tokenizer as an s3:// prefix holding the "
            "tokenizer and config.json (the server can still load weights from the PVC or the Hugging Face hub)"
        )
    raise PlanError(
        f"the operator cannot read config.json from {spec.model.path!r}: give spec.model.tokenizer as an s3:// "
        "prefix holding the tokenizer and config.json (the server can still load weights from the PVC)"
    )


def read_model_config(spec: DatasetGenerationSpec, credentials: dict[str, str] | None,
                      location: str | None = None) -> dict:
    """config.json of the model, from where make_plan reads it."""
    output = spec.output
    storage = open_storage(location or model_files_location(spec), output.endpoint, output.region, credentials)
    return orjson.loads(storage.get("config.json"))


def read_model_facts(spec: DatasetGenerationSpec, credentials: dict[str, str] | None, location: str | None = None,
                     retry: StorageRetry | None = None, local: bool = True) -> ModelFacts:
    """config.json (bounded) and the weight size (spec.model.weightBytes, else the safetensors index)."""
    output = spec.output
    storage = open_storage(location or model_files_location(spec, local), output.endpoint, output.region, credentials,
                           retry)
    config = orjson.loads(get_bounded(storage, "config.json", CONFIG_BYTES))
    weight_bytes = spec.model.weight_bytes
    if weight_bytes is None and storage.exists("model.safetensors.index.json"):
        weight_bytes = orjson.loads(get_bounded(storage, "model.safetensors.index.json", WEIGHT_INDEX_BYTES))["metadata"]["total_size"]
    if weight_bytes is None:
        raise PlanError(f"no model.safetensors.index.json at {storage.root_uri}: set spec.model.weightBytes")
    return model_facts(config, weight_bytes)


def make_plan(spec: DatasetGenerationSpec, credentials: dict[str, str] | None,
              work: Workload | None = None, location: str | None = None,
              retry: StorageRetry | None = None, node_driver_major: int | None = None,
              local: bool = True, constants: Constants | None = None) -> ServerPlan:
    """Read config.json (and the safetensors index unless spec.model.weightBytes is set), then plan the server.

    work overrides the job's lengths and concurrency (tokenmill plan's fixed-workload flags); location reads the
    model files from elsewhere than the spec says (tokenmill plan --model-files); retry bounds how long a failing store
    is retried (the operator's passes keep it short); node_driver_major is the GPU nodes' NVIDIA driver branch; local
    lets the model files be a local folder (tokenmill plan; never the operator's, model_files_location); constants
    are the cluster's measured ones (the operator's ConfigMap)."""
    facts = read_model_facts(spec, credentials, location, retry, local)
    return plan_with_constants(spec, facts, work, node_driver_major, constants)
