"""`tokenmill plan SPEC.yaml`: the server plan and the Kubernetes objects the operator would create.

Registered as a `tokenmill` subcommand through the `tokenmill.commands` entry point, so the runner's CLI never
imports the operator.
"""

from __future__ import annotations

import argparse
import sys

import orjson
import yaml

from tokenmill_runner.spec import load_spec_file

from . import manifests, names
from .model_files import make_plan
from .planner import render_plan

PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"


def register(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser("plan", help="the server plan and the Kubernetes objects the operator would create")
    plan.add_argument("spec", help="DatasetGeneration YAML file (model path: s3:// prefix or a local folder)")
    plan.add_argument("--json", action="store_true", help="the plan and the objects as JSON")
    plan.add_argument("--s3-endpoint", metavar="URL", help="S3 endpoint for the model files")
    plan.add_argument("--runner-image", default="ghcr.io/tokenmill/tokenmill-runner:0.1.0", help="runner image to show")
    plan.set_defaults(handler=run)


def objects(resource, plan, runner_image: str) -> list[dict]:
    name = resource.metadata.name
    namespace = resource.metadata.namespace or "default"
    spec = resource.spec
    owner = manifests.owner_reference({"apiVersion": resource.api_version, "kind": resource.kind,
                                       "metadata": {"name": name, "uid": PLACEHOLDER_UID}})
    urls = names.server_urls(name, namespace, spec.server.port, plan.replicas, plan.nodes_per_replica)
    return [
        manifests.api_key_secret(name, namespace, owner, "<generated at create time>"),
        manifests.server_service(name, namespace, owner, spec),
        manifests.network_policy(name, namespace, owner, spec),
        manifests.server_statefulset(name, namespace, owner, spec, plan),
        manifests.runner_configmap(name, namespace, owner, spec),
        manifests.runner_job(name, namespace, owner, spec, spec.runner.image or runner_image, urls),
    ]


def run(args: argparse.Namespace) -> int:
    resource = load_spec_file(args.spec)
    spec = resource.spec
    if args.s3_endpoint:
        spec = spec.model_copy(update={"output": spec.output.model_copy(update={"endpoint": args.s3_endpoint})})
        resource = resource.model_copy(update={"spec": spec})
    plan = make_plan(spec, credentials=None)
    children = objects(resource, plan, args.runner_image)
    if args.json:
        payload = {"plan": plan.model_dump(mode="json", by_alias=True), "objects": children}
        sys.stdout.write(orjson.dumps(payload, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        sys.stdout.write(render_plan(plan) + "\n\n# Objects the operator creates (the Secret's key is generated):\n")
        sys.stdout.write(yaml.safe_dump_all(children, sort_keys=False))
    return 0
