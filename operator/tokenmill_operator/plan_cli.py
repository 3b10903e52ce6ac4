"""`tokenmill plan SPEC.yaml`: the server plan and the Kubernetes objects the operator would create.

Registered as a `tokenmill` subcommand through the `tokenmill.commands` entry point, so the runner's CLI never
imports the operator.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import orjson
import yaml

from tokenmill_runner.facts.workload import Workload
from tokenmill_runner.source.survey import SurveyBounds
from tokenmill_runner.spec.resource import DatasetGenerationSpec, SpecError, load_spec_file
from tokenmill_runner.store.storage import StorageRetry, open_storage

from .decide import cache, kueue, manifests, names
from .decide.planner import model_facts, plan_server, render_plan, workload
from .observe.hidden_states_plan import HiddenStatesPlanError, hidden_states_plan, render_hidden_states
from .observe.model_files import files_or_known
from .observe.workload_sample import SurveyReader, surveyed_workload

PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"
# A plan is a look before anything runs: a store that does not answer is said (and the plan goes on without what
# it holds) within seconds, not after the run's 10-minute retry budget.
PLAN_RETRY = StorageRetry(budget_s=5.0)


def register(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser("plan", help="the server plan and the Kubernetes objects the operator would create")
    plan.add_argument("spec", help="DatasetGeneration YAML file (model path: s3:// prefix or a local folder)")
    plan.add_argument("--json", action="store_true", help="the plan and the objects as JSON")
    plan.add_argument("--s3-endpoint", metavar="URL", help="S3 endpoint for the model files")
    plan.add_argument("--runner-image", default="ghcr.io/tokenmill/tokenmill-runner:0.1.0", help="runner image to show")
    plan.add_argument("--model-files", metavar="DIR|S3", help="read config.json and model.safetensors.index.json "
                      "from here instead of spec.model.path (plan before the weights are uploaded; without it and "
                      "without the files, the facts tokenmill ships for the model are used when it knows it)")
    plan.add_argument("--node-cache-root", metavar="DIR",
                      default=os.environ.get(cache.NODE_ROOT_ENV) or cache.DEFAULT_NODE_ROOT,
                      help="the operator's node-local model cache folder (its TOKENMILL_NODE_CACHE_ROOT; default "
                           f"{cache.DEFAULT_NODE_ROOT})")
    plan.add_argument("--gpu-product", metavar="NAME", help="plan for this GPU product instead of "
                      "spec.server.gpuProduct (e.g. RTX-PRO-6000, H200, MI300X)")
    plan.add_argument("--sample-rows", type=_positive, metavar="N", default=SurveyBounds().sample_rows,
                      help="rows of each dataset tokenized for its prompt and earlier answers' lengths, spread over "
                      "the source (default %(default)s); every source's rows are counted too, exactly within "
                      f"{SurveyBounds().max_bytes // 2**20} MiB read, else estimated from the bytes a row takes")
    plan.add_argument("--tokenizer", metavar="DIR|S3", help="the tokenizer for the prompts' lengths (default: "
                      "spec.model.tokenizer, else spec.model.path)")
    plan.add_argument("--source", action="append", default=[], metavar="DATASET=FILE", type=_source,
                      help="read this dataset's rows from a local copy instead of its source (plan before the data "
                      "is uploaded, or without the store's credentials); repeatable")
    fixed = plan.add_argument_group("a fixed workload instead of the estimate (the seeds' length shape per dataset)")
    fixed.add_argument("--prompt-tokens", type=_positive, metavar="N", help="every prompt is N tokens")
    fixed.add_argument("--output-tokens", type=_positive, metavar="N", help="every output is N tokens (capped at the "
                       "dataset's maxNewTokens)")
    fixed.add_argument("--concurrency", type=_positive, metavar="N", help="N requests in flight over all servers")
    plan.set_defaults(handler=run)


def _source(text: str) -> tuple[str, str]:
    name, _, path = text.partition("=")
    if not name or not path:
        raise argparse.ArgumentTypeError(f"expected DATASET=FILE, got {text!r}")
    return name, path


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


def surveyed(spec: DatasetGenerationSpec, args: argparse.Namespace) -> Workload:
    """The job as its sources say it is (observe/workload_sample.py): rows counted, prompts tokenized."""
    local = dict(args.source)
    unknown = sorted(set(local) - {d.name for d in spec.datasets})
    if unknown:
        raise SpecError(f"--source names no dataset of the spec: {', '.join(unknown)} (its datasets: "
                        f"{', '.join(d.name for d in spec.datasets)})")
    read = spec.model_copy(update={"datasets": [d.model_copy(update={"source": local.get(d.name, d.source)})
                                                for d in spec.datasets]})
    output = spec.output
    reader = SurveyReader(endpoint=output.endpoint,
                          opener=lambda uri: open_storage(uri, output.endpoint, output.region, None, PLAN_RETRY),
                          bounds=replace(SurveyBounds(), sample_rows=args.sample_rows), retry=PLAN_RETRY,
                          hint="give the store's credentials (AWS_ACCESS_KEY_ID ...) or --s3-endpoint, or "
                               "--source DATASET=FILE to plan from a local copy")
    location = args.tokenizer or spec.model.tokenizer or spec.model.path
    tokenizer_hint = replace(reader, hint="give --tokenizer DIR|S3 to count tokens instead")
    work = surveyed_workload(read, workload(read), location, tokenizer_hint if local else reader)
    # The plan's datasets keep the spec's sources (the objects it prints name them); only the counts came from
    # the local copies.
    return work


def run(args: argparse.Namespace) -> int:
    resource = load_spec_file(args.spec)
    spec = resource.spec
    if args.s3_endpoint:
        spec = spec.model_copy(update={"output": spec.output.model_copy(update={"endpoint": args.s3_endpoint})})
    if args.gpu_product:
        spec = spec.model_copy(update={"server": spec.server.model_copy(update={"gpu_product": args.gpu_product})})
    resource = resource.model_copy(update={"spec": spec})
    if spec.server.gpu_product is None and spec.server.gpu_memory_mib is None:
        raise SpecError("GPU memory unknown: give --gpu-product NAME (e.g. --gpu-product NVIDIA-H200, RTX-PRO-6000, "
                        "MI300X) or set spec.server.gpuProduct (or spec.server.gpuMemoryMib)")
    config, weight_bytes, known_note = files_or_known(spec, args.model_files, PLAN_RETRY)
    fixed = args.prompt_tokens or args.output_tokens or args.concurrency
    work = (workload(spec, args.prompt_tokens, args.output_tokens, args.concurrency) if fixed
            else surveyed(spec, args))
    plan = plan_server(spec, model_facts(config, weight_bytes), work=work)
    if known_note:
        plan = plan.model_copy(update={"reasoning": [known_note, *plan.reasoning]})
    try:
        states = hidden_states_plan(spec, work, config)
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
