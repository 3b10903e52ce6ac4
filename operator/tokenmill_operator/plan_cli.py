"""`tokenmill plan SPEC.yaml`: the server plan and the Kubernetes objects the operator would create.

Registered as a `tokenmill` subcommand through the `tokenmill.commands` entry point, so the runner's CLI never
imports the operator.
"""

from __future__ import annotations

import argparse
import os
import sys

import orjson
import yaml

from tokenmill_runner.spec.resource import SpecError, load_spec_file

from .decide import cache, kueue, manifests, names
from .decide.planner import render_plan, workload
from .observe.hidden_states_plan import HiddenStatesPlanError, hidden_states_plan, render_hidden_states
from .observe.model_files import make_plan
from .observe.workload_sample import sampled_workload

PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"


def register(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser("plan", help="the server plan and the Kubernetes objects the operator would create")
    plan.add_argument("spec", help="DatasetGeneration YAML file (model path: s3:// prefix or a local folder)")
    plan.add_argument("--json", action="store_true", help="the plan and the objects as JSON")
    plan.add_argument("--s3-endpoint", metavar="URL", help="S3 endpoint for the model files")
    plan.add_argument("--runner-image", default="ghcr.io/tokenmill/tokenmill-runner:0.1.0", help="runner image to show")
    plan.add_argument("--model-files", metavar="DIR|S3", help="read config.json and model.safetensors.index.json "
                      "from here instead of spec.model.path (plan before the weights are uploaded)")
    plan.add_argument("--node-cache-root", metavar="DIR",
                      default=os.environ.get(cache.NODE_ROOT_ENV) or cache.DEFAULT_NODE_ROOT,
                      help="the operator's node-local model cache folder (its TOKENMILL_NODE_CACHE_ROOT; default "
                           f"{cache.DEFAULT_NODE_ROOT})")
    plan.add_argument("--gpu-product", metavar="NAME", help="plan for this GPU product instead of "
                      "spec.server.gpuProduct (e.g. RTX-PRO-6000, H200, MI300X)")
    plan.add_argument("--sample-rows", type=_positive, metavar="N", help="tokenize up to N rows of each dataset "
                      "(streamed from its source) for its prompt lengths and earlier answers' lengths, instead of the "
                      "flat 512-token estimate; also sets --context-length to what the job needs")
    plan.add_argument("--tokenizer", metavar="DIR|S3", help="the tokenizer for --sample-rows (default: "
                      "spec.model.tokenizer, else spec.model.path)")
    fixed = plan.add_argument_group("a fixed workload instead of the estimate (the seeds' length shape per dataset)")
    fixed.add_argument("--prompt-tokens", type=_positive, metavar="N", help="every prompt is N tokens")
    fixed.add_argument("--output-tokens", type=_positive, metavar="N", help="every output is N tokens (capped at the "
                       "dataset's maxNewTokens)")
    fixed.add_argument("--concurrency", type=_positive, metavar="N", help="N requests in flight over all servers")
    plan.set_defaults(handler=run)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def objects(resource, plan, runner_image: str, node_root: str = cache.DEFAULT_NODE_ROOT) -> list[dict]:
    name = resource.metadata.name
    namespace = resource.metadata.namespace or "default"
    spec = resource.spec
    owner = manifests.owner_reference({"apiVersion": resource.api_version, "kind": resource.kind,
                                       "metadata": {"name": name, "uid": PLACEHOLDER_UID}})
    urls = names.server_urls(name, namespace, spec.server.port, plan.replicas, plan.nodes_per_replica)
    image = spec.runner.image or runner_image
    queue = kueue.queue_name((resource.metadata.model_extra or {}).get("labels"))
    shared = spec.model.cache is not None and spec.model.cache.mode == "sharedVolume"
    digest = cache.model_digest(spec, plan.weight_bytes)
    return [
        *([kueue.run_workload(name, namespace, owner, queue, spec, plan, image, node_root)] if queue else []),
        *([cache.shared_claim(namespace, spec.model.cache, digest, plan.weight_bytes),
           cache.fill_job(namespace, spec, digest)] if shared else []),
        manifests.api_key_secret(name, namespace, owner, "<generated at create time>"),
        manifests.server_service(name, namespace, owner, spec),
        manifests.network_policy(name, namespace, owner, spec),
        manifests.runner_network_policy(name, namespace, owner),
        manifests.server_statefulset(name, namespace, owner, spec, plan, node_root=node_root),
        manifests.runner_configmap(name, namespace, owner, spec),
        manifests.runner_job(name, namespace, owner, spec, image, urls),
    ]


def run(args: argparse.Namespace) -> int:
    resource = load_spec_file(args.spec)
    spec = resource.spec
    if args.s3_endpoint:
        spec = spec.model_copy(update={"output": spec.output.model_copy(update={"endpoint": args.s3_endpoint})})
    if args.gpu_product:
        spec = spec.model_copy(update={"server": spec.server.model_copy(update={"gpu_product": args.gpu_product})})
    resource = resource.model_copy(update={"spec": spec})
    fixed = args.prompt_tokens or args.output_tokens or args.concurrency
    work = workload(spec, args.prompt_tokens, args.output_tokens, args.concurrency) if fixed else None
    if args.sample_rows:
        location = args.tokenizer or spec.model.tokenizer or spec.model.path
        work = sampled_workload(spec, work or workload(spec), location, args.sample_rows)
    plan = make_plan(spec, credentials=None, work=work, location=args.model_files)
    try:
        states = hidden_states_plan(spec, work or workload(spec), args.model_files)
    except HiddenStatesPlanError as error:
        sys.stderr.write(f"error: {error}\n")
        return 2
    node_root = cache.node_root(args.node_cache_root)
    if refused := cache.host_path_refusal(spec.model.cache, node_root):
        raise SpecError(refused)
    children = objects(resource, plan, args.runner_image, node_root)
    if args.json:
        payload = {"plan": plan.model_dump(mode="json", by_alias=True), "objects": children}
        if states is not None:
            payload["hiddenStates"] = {"bytes": states.total, "perDataset": states.per_dataset,
                                       "bytesPerToken": states.shape.bytes_per_token}
        sys.stdout.write(orjson.dumps(payload, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        sys.stdout.write(render_plan(plan) + "\n")
        if states is not None:
            sys.stdout.write("\n" + render_hidden_states(states) + "\n")
        sys.stdout.write("\n# Objects the operator creates (the Secret's key is generated):\n")
        sys.stdout.write(yaml.safe_dump_all(children, sort_keys=False))
    return 0
