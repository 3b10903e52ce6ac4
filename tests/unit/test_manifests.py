"""The children of a DatasetGeneration as plain dicts: server, network policy, runner Job and their wiring."""

from __future__ import annotations

import base64
import json
import os
import re
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tokenmill_operator.decide import manifests, names
from tokenmill_operator.decide.planner import ServerPlan
from tokenmill_runner import cli
from tokenmill_runner.spec.resource import DatasetGenerationSpec, parse_document

NAME, NAMESPACE = "b5-openthoughts", "gen"
UID = "0d5f4c1e-1111-2222-3333-444455556666"
CR_LABELS = {"app.kubernetes.io/instance": "argo-app", "team": "research"}


def spec(**updates: Any) -> DatasetGenerationSpec:
    document = {
        "apiVersion": "tokenmill.io/v1alpha1",
        "kind": "DatasetGeneration",
        "metadata": {"name": NAME, "namespace": NAMESPACE, "labels": CR_LABELS},
        "spec": {
            "model": {"path": "pvc://weights/kimi-k2.5", "trustRemoteCode": True},
            "server": {"gpuProduct": "NVIDIA-H200", "extraArgs": ["--chunked-prefill-size", "4096"],
                       "startupTimeoutSeconds": 2705},
            "datasets": [{"name": "B5_openthoughts", "source": "s3://prompts/b5.jsonl"}],
            "runner": {"parallelism": 4},
            "output": {"uri": "s3://bucket/run/", "endpoint": "http://minio.storage:9000",
                       "credentialsSecret": "s3-creds"},
        },
    }
    for path, value in updates.items():
        section, field = path.split("__")
        document["spec"].setdefault(section, {})[field] = value
    return parse_document(document).spec


def plan(**updates: Any) -> ServerPlan:
    values = dict(tensor_parallel=8, nodes_per_replica=1, gpus_per_node=8, replicas=1, mem_fraction_static="0.88",
                  context_length=65536, max_running_requests=256, kv_cache_dtype="auto", gpu_product="NVIDIA-H200",
                  gpu_memory_mib=143771, weight_bytes=600 * 2**30, weight_bytes_per_gpu=75 * 2**30,
                  kv_bytes_per_token=70272, kv_capacity_tokens=800000, expected_tokens_per_request=4000,
                  concurrent_requests_at_expected_length=200)
    return ServerPlan(**{**values, **updates})


OWNER = manifests.owner_reference({
    "apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration",
    "metadata": {"name": NAME, "namespace": NAMESPACE, "uid": UID, "labels": CR_LABELS},
})
URLS = names.server_urls(NAME, NAMESPACE, 30000, replicas=1)


def _doc() -> dict:
    """A minimal document: s3 model, no endpoint, no credentials."""
    return {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": NAME},
            "spec": {"model": {"path": "s3://m/"}, "datasets": [{"name": "a", "source": "s3://p/a.jsonl"}],
                     "output": {"uri": "s3://o/"}}}


def statefulset(s: DatasetGenerationSpec | None = None, p: ServerPlan | None = None, **kw: Any) -> dict:
    return manifests.server_statefulset(NAME, NAMESPACE, OWNER, s or spec(), p or plan(), **kw)


def job(s: DatasetGenerationSpec | None = None, urls: list[str] | None = None) -> dict:
    return manifests.runner_job(NAME, NAMESPACE, OWNER, s or spec(), "ghcr.io/x/tokenmill:0.1.0",
                                urls or URLS)


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def container(obj: dict) -> dict:
    return pod_spec(obj)["containers"][0]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def volume(obj: dict, name: str) -> dict:
    return next(v for v in pod_spec(obj)["volumes"] if v["name"] == name)


def all_children(s: DatasetGenerationSpec | None = None) -> list[dict]:
    s = s or spec()
    return [
        manifests.api_key_secret(NAME, NAMESPACE, OWNER, "k3y"),
        manifests.server_service(NAME, NAMESPACE, OWNER, s),
        statefulset(s),
        manifests.network_policy(NAME, NAMESPACE, OWNER, s),
        manifests.runner_configmap(NAME, NAMESPACE, OWNER, s),
        job(s),
    ]


# ------------------------------------------------------------------------------------------------ server args


def test_server_args_come_from_the_plan():
    c = container(statefulset(p=plan(tensor_parallel=8, mem_fraction_static="0.871", context_length=131072,
                                     max_running_requests=384)))
    args = c["args"]
    assert c["command"] == ["python3", "-m", "sglang.launch_server"]
    assert flag(args, "--host") == "0.0.0.0"
    assert flag(args, "--port") == "30000"
    assert flag(args, "--tp-size") == "8"
    assert flag(args, "--mem-fraction-static") == "0.871"
    assert flag(args, "--context-length") == "131072"
    assert flag(args, "--max-running-requests") == "384"
    assert flag(args, "--served-model-name") == NAME
    assert "--enable-metrics" in args and "--trust-remote-code" in args
    assert "--kv-cache-dtype" not in args  # auto is SGLang's default
    assert not any("parser" in arg for arg in args)  # raw output_ids: no reasoning or tool-call parser
    assert args[-2:] == ["--chunked-prefill-size", "4096"]  # extraArgs last: the user's flags win


def test_deterministic_inference_only_when_asked():
    # --enable-deterministic-inference exists in every supported release (0.5.9 server_args.py:4755; 0.5.23
    # arg_groups/fields/exec_.py:1153); without it SGLang ignores sampling_seed.
    assert "--enable-deterministic-inference" not in container(statefulset())["args"]
    args = container(statefulset(spec(server__deterministicInference=True)))["args"]
    assert "--enable-deterministic-inference" in args
    assert args[-2:] == ["--chunked-prefill-size", "4096"]  # extraArgs still last


def test_kv_cache_dtype_and_tokenizer_when_set():
    s = spec(model__tokenizer="pvc://weights/kimi-k2.5/tokenizer", model__trustRemoteCode=False)
    args = container(statefulset(s, plan(kv_cache_dtype="fp8_e4m3")))["args"]
    assert flag(args, "--kv-cache-dtype") == "fp8_e4m3"
    assert flag(args, "--tokenizer-path") == "/models/kimi-k2.5/tokenizer"  # same claim, one volume
    assert "--trust-remote-code" not in args
    assert [v["name"] for v in pod_spec(statefulset(s))["volumes"]] == ["dshm", "models"]


@pytest.mark.parametrize(("version", "expected"), [
    # DP attention: `--dp-size N --enable-dp-attention` until 0.5.21, `--attn-dp-size N` from 0.5.22
    # (0.5.22 arg_groups/fields/parallel.py:81; the old spelling deprecated, 0.5.23 arg_groups/parallel_hook.py:40).
    # The decode CUDA-graph batch: `--cuda-graph-max-bs` until 0.5.13.post1, `--cuda-graph-max-bs-decode` from 0.5.14
    # (the old name an alias until it became an ambiguous prefix in 0.5.20).
    ("0.5.9", ["--dp-size", "8", "--enable-dp-attention", "--cuda-graph-max-bs", "160"]),
    ("0.5.19", ["--dp-size", "8", "--enable-dp-attention", "--cuda-graph-max-bs-decode", "160"]),
    ("0.5.23", ["--attn-dp-size", "8", "--cuda-graph-max-bs-decode", "160"]),
])
def test_dp_attention_is_spelled_as_the_release_spells_it(version, expected):
    args = container(statefulset(p=plan(attention_data_parallel=8, cuda_graph_max_bs=160,
                                        sglang_version=version)))["args"]
    start = args.index(expected[0])
    assert args[start:start + len(expected)] == expected
    plain = container(statefulset(p=plan(sglang_version=version)))["args"]
    assert not {"--dp-size", "--attn-dp-size", "--enable-dp-attention"} & set(plain)


def test_amd_plans_ask_for_amd_gpus_on_amd_nodes():
    sts = statefulset(p=plan(gpu_vendor="amd", gpu_product="AMD_Instinct_MI300X_OAM"))
    c, pod = container(sts), pod_spec(sts)
    assert c["resources"]["limits"] == {"amd.com/gpu": "8"} and "nvidia.com/gpu" not in c["resources"]["requests"]
    assert pod["nodeSelector"]["amd.com/gpu.product-name"] == "AMD_Instinct_MI300X_OAM"
    assert {"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def test_api_key_comes_from_the_secret_never_inline():
    sts = statefulset()
    c = container(sts)
    assert flag(c["args"], "--api-key") == "$(SGLANG_API_KEY)"
    env = {e["name"]: e for e in c["env"]}
    assert env["SGLANG_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "b5-openthoughts-server-key",
                                                                  "key": "api-key"}
    secret = manifests.api_key_secret(NAME, NAMESPACE, OWNER, "s3cr3t")
    assert secret["metadata"]["name"] == "b5-openthoughts-server-key" and secret["type"] == "Opaque"
    assert base64.b64decode(secret["data"]["api-key"]).decode() == "s3cr3t"
    for obj in all_children():
        if obj["kind"] != "Secret":
            assert "k3y" not in yaml.safe_dump(obj)
    runner_env = {e["name"]: e for e in container(job())["env"]}
    assert runner_env["TOKENMILL_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "b5-openthoughts-server-key"


# ------------------------------------------------------------------------------------------- GPU pod shape


def test_gpu_limit_toleration_and_node_selector():
    s = spec(server__resources={"limits": {"memory": "1Ti", "nvidia.com/gpu": "2"}, "requests": {"cpu": "32"}},
             server__nodeSelector={"pool": "gpu"},
             server__tolerations=[{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}])
    sts = statefulset(s, plan(gpus_per_node=8))
    resources = container(sts)["resources"]
    assert resources["limits"] == {"memory": "1Ti", "nvidia.com/gpu": "8"}  # the plan's count wins
    assert resources["requests"] == {"cpu": "32", "memory": "64Gi", "nvidia.com/gpu": "8"}  # the spec's cpu wins
    tolerations = pod_spec(sts)["tolerations"]
    assert tolerations[0] == {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    assert tolerations[1]["key"] == "dedicated"
    assert pod_spec(sts)["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200", "pool": "gpu"}


def test_no_node_selector_without_a_product():
    sts = statefulset(spec(server__gpuProduct=None), plan(gpu_product=None))
    assert "nodeSelector" not in pod_spec(sts)


def test_dev_shm_is_memory_backed_with_the_spec_size():
    sts = statefulset(spec(server__shmSize="32Gi"))
    assert volume(sts, "dshm") == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container(sts)["volumeMounts"]


def test_startup_probe_covers_the_weight_load_and_tolerates_slow_health():
    c = container(statefulset(spec(server__startupTimeoutSeconds=2705)))
    startup = c["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 2705
    assert startup["failureThreshold"] == 271
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["timeoutSeconds"] >= 5
        assert c[probe]["httpGet"]["port"] == "http"
    assert c["readinessProbe"]["httpGet"]["path"] == "/health_generate"
    assert {"name": "http", "containerPort": 30000, "protocol": "TCP"} in c["ports"]


def test_server_security_context():
    sts = statefulset()
    security = container(sts)["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert "privileged" not in security and "readOnlyRootFilesystem" not in security
    assert pod_spec(sts)["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    assert pod_spec(sts)["terminationGracePeriodSeconds"] == 60
    assert pod_spec(sts)["automountServiceAccountToken"] is False


def test_server_pod_requests_cpu_and_the_memory_of_its_dev_shm():
    """Not BestEffort (the first evicted): a CPU per GPU, and the /dev/shm tmpfs that is charged to its memory."""
    requests = container(statefulset(spec(server__shmSize="96Gi"), plan(gpus_per_node=8)))["resources"]["requests"]
    assert requests == {"cpu": "8", "memory": "96Gi", "nvidia.com/gpu": "8"}


def test_statefulset_shape_and_scaling():
    sts = statefulset(p=plan(replicas=3))
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["serviceName"] == "b5-openthoughts-server"
    assert container(sts)["image"] == "lmsysorg/sglang:v0.5.23"
    assert statefulset(replicas=0)["spec"]["replicas"] == 0  # suspended or finished: GPUs freed
    selector = sts["spec"]["selector"]["matchLabels"]
    assert selector.items() <= sts["spec"]["template"]["metadata"]["labels"].items()


def test_headless_service():
    service = manifests.server_service(NAME, NAMESPACE, OWNER, spec())
    assert service["metadata"]["name"] == "b5-openthoughts-server"
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert {(p["name"], p["port"]) for p in service["spec"]["ports"]} == {("http", 30000), ("dist", 5000)}
    assert service["spec"]["selector"] == statefulset()["spec"]["selector"]["matchLabels"]


# ---------------------------------------------------------------------------------------------- multi-node


def _kubelet_expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion of command and args ($$ escapes; unknown references stay as written)."""
    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return re.sub(r"\$\$|\$\(([^)]*)\)", one, text)


def _launch(sts: dict, pod_index: int, tmp_path: Path) -> list[str]:
    """Run the pod's command as the kubelet would, with a stand-in python3 that prints the arguments it gets."""
    fake = tmp_path / "python3"
    fake.write_text('#!/bin/sh\nfor arg in "$@"; do printf "%s\\n" "$arg"; done\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {"POD_INDEX": str(pod_index), "SGLANG_API_KEY": "k3y", "HOSTNAME": "ignored-9",
           "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    c = container(sts)
    argv = [_kubelet_expand(part, env) for part in c["command"] + c["args"]]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, timeout=30)
    return done.stdout.splitlines()


@pytest.mark.parametrize(("index", "rank", "leader"), [(0, 0, 0), (1, 1, 0), (2, 0, 2), (3, 1, 2)])
def test_multi_node_ranks_come_from_the_pod_index(tmp_path: Path, index: int, rank: int, leader: int):
    sts = statefulset(p=plan(tensor_parallel=16, nodes_per_replica=2, replicas=2))
    assert sts["spec"]["replicas"] == 4
    argv = _launch(sts, index, tmp_path)
    assert argv[:2] == ["-m", "sglang.launch_server"]
    assert flag(argv, "--nnodes") == "2"
    assert flag(argv, "--node-rank") == str(rank)
    assert flag(argv, "--dist-init-addr") == f"b5-openthoughts-server-{leader}.b5-openthoughts-server.gen.svc:5000"
    assert flag(argv, "--tp-size") == "16"
    assert flag(argv, "--api-key") == "k3y"
    assert argv[-2:] == ["--chunked-prefill-size", "4096"]


def test_multi_node_pod_index_comes_from_the_downward_api():
    c = container(statefulset(p=plan(nodes_per_replica=2, replicas=1)))
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert c["command"][:2] == ["bash", "-c"]
    assert "$(" not in c["command"][2]  # the kubelet would treat it as a variable reference


def test_multi_node_falls_back_to_the_hostname(tmp_path: Path):
    sts = statefulset(p=plan(nodes_per_replica=2, replicas=2))
    c = container(sts)
    fake = tmp_path / "python3"
    fake.write_text('#!/bin/sh\nfor arg in "$@"; do printf "%s\\n" "$arg"; done\n')
    fake.chmod(0o755)
    env = {"HOSTNAME": "b5-openthoughts-server-3", "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    out = subprocess.run(c["command"] + ["--x"], env=env, capture_output=True, text=True, check=True).stdout
    argv = out.splitlines()
    assert flag(argv, "--node-rank") == "1" and "server-2." in flag(argv, "--dist-init-addr")
    bad = subprocess.run(c["command"], env={**env, "POD_INDEX": "x1"}, capture_output=True, text=True)
    assert bad.returncode != 0


def test_single_node_has_no_rank_flags():
    args = container(statefulset())["args"]
    assert "--nnodes" not in args and "--dist-init-addr" not in args


# ---------------------------------------------------------------------------------------------- model files


def test_pvc_model_is_mounted_read_only():
    sts = statefulset(spec(model__path="pvc://weights/org/kimi-k2.5/"))
    assert volume(sts, "models") == {"name": "models",
                                     "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in container(sts)["volumeMounts"]
    assert flag(container(sts)["args"], "--model-path") == "/models/org/kimi-k2.5"
    assert "initContainers" not in pod_spec(sts)


def test_s3_model_is_synced_by_an_init_container():
    sts = statefulset(spec(model__path="s3://models/kimi-k2.5"))
    assert volume(sts, "models") == {"name": "models", "emptyDir": {}}
    (init,) = pod_spec(sts)["initContainers"]
    assert init["image"] == manifests.DEFAULT_MODEL_SYNC_IMAGE
    assert init["command"][:5] == ["aws", "s3", "sync", "s3://models/kimi-k2.5/", "/models/model"]
    assert flag(init["command"], "--endpoint-url") == "http://minio.storage:9000"
    assert init["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    assert {"name": "models", "mountPath": "/models"} in init["volumeMounts"]
    assert init["securityContext"]["runAsNonRoot"] is True and init["securityContext"]["runAsUser"] != 0
    assert flag(container(sts)["args"], "--model-path") == "/models/model"
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in container(sts)["volumeMounts"]


def test_s3_tokenizer_syncs_without_weights():
    sts = statefulset(spec(model__path="s3://models/kimi-k2.5/", model__tokenizer="s3://models/kimi-tok/"))
    init = {c["name"]: c for c in pod_spec(sts)["initContainers"]}
    assert set(init) == {"sync-models", "sync-tokenizer"}
    assert "*.safetensors" in init["sync-tokenizer"]["command"]
    assert flag(container(sts)["args"], "--tokenizer-path") == "/tokenizer/model"


def test_hub_id_passes_through():
    sts = statefulset(spec(model__path="moonshotai/Kimi-K2.5"))
    assert flag(container(sts)["args"], "--model-path") == "moonshotai/Kimi-K2.5"
    assert [v["name"] for v in pod_spec(sts)["volumes"]] == ["dshm"]


# ------------------------------------------------------------------------------------------------ network


def test_network_policy_lets_only_the_runner_reach_the_api():
    policy = manifests.network_policy(NAME, NAMESPACE, OWNER, spec())
    body = policy["spec"]
    assert policy["metadata"]["name"] == "b5-openthoughts-server"
    assert body["policyTypes"] == ["Ingress"]
    assert body["podSelector"]["matchLabels"] == names.selector_labels(NAME, "server")
    runner, peers = body["ingress"]  # no scraper namespace set: no scraper
    assert runner["from"] == [{"podSelector": {"matchLabels": names.selector_labels(NAME, "runner")}}]
    assert runner["ports"] == [{"protocol": "TCP", "port": 30000}]
    assert peers == {"from": [{"podSelector": {"matchLabels": names.selector_labels(NAME, "server")}}]}
    # The scraper by label alone, from any namespace, could call /health_generate without the key: pinned now.
    *_, prometheus = manifests.network_policy(NAME, NAMESPACE, OWNER, spec(), "monitoring")["spec"]["ingress"]
    assert prometheus["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                                   "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]
    assert prometheus["ports"] == [{"protocol": "TCP", "port": 30000}]
    # The runner's pod labels match the runner peer.
    assert names.selector_labels(NAME, "runner").items() <= job()["spec"]["template"]["metadata"]["labels"].items()


def test_the_operator_reads_the_servers_metrics_from_its_own_namespace_only():
    ingress = manifests.network_policy(NAME, NAMESPACE, OWNER, spec(), None, "tokenmill-system")["spec"]["ingress"]
    *_, operator = ingress
    assert operator["from"] == [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "tokenmill-system"}}, "podSelector": {"matchLabels": {
            "app.kubernetes.io/component": "operator", "app.kubernetes.io/part-of": "tokenmill"}}}]
    assert operator["ports"] == [{"protocol": "TCP", "port": 30000}]
    assert len(manifests.network_policy(NAME, NAMESPACE, OWNER, spec())["spec"]["ingress"]) == len(ingress) - 1


def test_runner_pods_admit_only_the_scraper_on_the_metrics_port():
    closed = manifests.runner_network_policy(NAME, NAMESPACE, OWNER)["spec"]
    assert closed["podSelector"]["matchLabels"] == names.selector_labels(NAME, "runner") and closed["ingress"] == []
    (scraper,) = manifests.runner_network_policy(NAME, NAMESPACE, OWNER, "monitoring")["spec"]["ingress"]
    assert scraper["from"][0]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    assert scraper["ports"] == [{"protocol": "TCP", "port": 9400}]
    args = manifests.runner_args(spec(), ["http://s:30000"])
    assert args[args.index("--metrics-port"):][:4] == ["--metrics-port", "9400", "--metrics-address", "0.0.0.0"]


def test_server_urls_point_at_rank_zero_pods():
    assert names.server_urls(NAME, NAMESPACE, 30000, replicas=2, nodes_per_replica=2) == [
        "http://b5-openthoughts-server-0.b5-openthoughts-server.gen.svc:30000",
        "http://b5-openthoughts-server-2.b5-openthoughts-server.gen.svc:30000",
    ]
    assert len(names.server_urls(NAME, NAMESPACE, 8000, replicas=3)) == 3


# -------------------------------------------------------------------------------------------------- runner


def test_runner_job_is_indexed_with_per_index_retries():
    body = job(spec(runner__parallelism=6))["spec"]
    assert body["completionMode"] == "Indexed"
    assert body["completions"] == body["parallelism"] == 6
    assert body["backoffLimitPerIndex"] == 3
    assert body["maxFailedIndexes"] == 6
    assert body["podReplacementPolicy"] == "Failed"
    assert body["suspend"] is False
    assert "ttlSecondsAfterFinished" not in body and "backoffLimit" not in body
    assert body["template"]["spec"]["restartPolicy"] == "Never"
    rules = body["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
    assert rules[1]["action"] == "FailJob"
    assert rules[1]["onExitCodes"] == {"containerName": "runner", "operator": "In", "values": [cli.EXIT_USAGE]}
    assert cli.EXIT_FAILED not in rules[1]["onExitCodes"]["values"]  # exit 1 may be transient: retried


def test_given_up_is_not_retried_and_an_outage_is():
    # Exit codes of `tokenmill run` (docs/reliability.md): 3 = finished with samples given up, a new pod would end
    # the same way; 4 = no server live past the outage budget, nothing written off, a new pod continues; 5 = a
    # dataset has no sample (an empty source, or every row failed for its input): no retry changes the input.
    rules = job()["spec"]["podFailurePolicy"]["rules"]
    by_code = {rule["onExitCodes"]["values"][0]: rule["action"] for rule in rules if "onExitCodes" in rule}
    assert by_code == {2: "FailJob", 3: "FailIndex", 4: "Count", 5: "FailJob"}
    assert all(rule["onExitCodes"]["containerName"] == "runner" for rule in rules if "onExitCodes" in rule)


def test_retry_runs_the_runner_with_retry_failed():
    assert "--retry-failed" not in container(job())["args"]
    retried = manifests.runner_job(NAME, NAMESPACE, OWNER, spec(), "img", URLS, retry_token="1700000000")
    assert container(retried)["args"][-1] == "--retry-failed"
    assert retried["metadata"]["annotations"]["tokenmill.io/retry-failed"] == "1700000000"
    assert "--retry-failed" in container(job(spec(runner__retryFailed=True)))["args"]
    parsed = cli.build_parser().parse_args(container(retried)["args"])
    assert parsed.retry_failed


def test_job_hash_follows_what_the_pods_depend_on_and_not_suspend():
    base = manifests.runner_job_hash(spec(), URLS)
    assert job()["metadata"]["annotations"]["tokenmill.io/job-hash"] == base
    assert manifests.runner_job_hash(spec().model_copy(update={"suspend": True}), URLS) == base
    changed = {
        "sampling": spec(sampling__maxNewTokens=2048),
        "parallelism": spec(runner__parallelism=2),
        "image": spec(runner__image="ghcr.io/x/other:1"),
        "retryFailed": spec(runner__retryFailed=True),
    }
    for what, other in changed.items():
        assert manifests.runner_job_hash(other, URLS) != base, what
    assert manifests.runner_job_hash(spec(), names.server_urls(NAME, NAMESPACE, 30000, replicas=2)) != base
    assert manifests.runner_job_hash(spec(), URLS, retry_token="1") != base


def test_job_records_what_the_run_started_with():
    run = json.loads(job(spec(model__path="s3://models/kimi/"))["metadata"]["annotations"]["tokenmill.io/run"])
    assert run == {"modelPath": "s3://models/kimi/", "tokenizer": "s3://models/kimi/", "outputUri": "s3://bucket/run/"}


def test_runner_job_suspends_with_the_spec():
    document = _doc()
    document["spec"]["suspend"] = True
    assert job(parse_document(document).spec)["spec"]["suspend"] is True


def test_runner_command_line():
    urls = names.server_urls(NAME, NAMESPACE, 30000, replicas=2)
    c = container(job(urls=urls))
    assert c["command"] == ["tokenmill"]
    assert c["image"] == "ghcr.io/x/tokenmill:0.1.0"
    args = c["args"]
    assert args[:2] == ["run", "/etc/tokenmill/spec.yaml"]
    assert flag(args, "--out") == "s3://bucket/run/"
    assert flag(args, "--workers") == "4"
    assert [args[i + 1] for i, a in enumerate(args) if a == "--server"] == urls
    assert flag(args, "--s3-endpoint") == "http://minio.storage:9000"
    parsed = cli.build_parser().parse_args(args)  # the runner's own parser accepts it
    assert parsed.server == urls and parsed.workers == 4


def test_runner_without_endpoint_or_credentials():
    s = parse_document(_doc()).spec
    c = container(job(s))
    assert "--s3-endpoint" not in c["args"]
    assert "envFrom" not in c


def test_runner_security():
    j = job()
    pod = pod_spec(j)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["fsGroup"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container(j)["securityContext"]
    assert security == {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]}}
    assert volume(j, "tmp") == {"name": "tmp", "emptyDir": {}}
    assert {"name": "tmp", "mountPath": "/tmp"} in container(j)["volumeMounts"]
    env = {e["name"]: e.get("value") for e in container(j)["env"]}
    assert env["HF_HOME"].startswith("/tmp/") and env["TOKENMILL_CACHE"].startswith("/tmp/")


def test_runner_s3_credentials_and_metrics_port():
    c = container(job())
    assert c["envFrom"] == [{"secretRef": {"name": "s3-creds", "optional": False}}]
    assert c["ports"] == [{"name": "metrics", "containerPort": 9400, "protocol": "TCP"}]
    assert c["resources"]["requests"] == {"cpu": "1", "memory": "2Gi"}


def test_runner_reads_the_spec_from_the_configmap():
    j = job()
    assert volume(j, "config") == {"name": "config", "configMap": {"name": "b5-openthoughts-runner"}}
    assert {"name": "config", "mountPath": "/etc/tokenmill", "readOnly": True} in container(j)["volumeMounts"]
    cm = manifests.runner_configmap(NAME, NAMESPACE, OWNER, spec(model__path="s3://models/kimi/"))
    document = yaml.safe_load(cm["data"]["spec.yaml"])
    assert document["apiVersion"] == "tokenmill.io/v1alpha1" and document["kind"] == "DatasetGeneration"
    assert document["metadata"] == {"name": NAME, "namespace": NAMESPACE}
    resource = parse_document(document)  # the runner's own model reads it back unchanged
    assert resource.spec == spec(model__path="s3://models/kimi/")
    assert "runner" in document["spec"] and "shardMaxSamples" in document["spec"]["runner"]  # camelCase


def test_pvc_tokenizer_is_mounted_in_the_runner():
    s = spec(model__path="pvc://weights/kimi-k2.5")
    j = job(s)
    assert volume(j, "models")["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    document = yaml.safe_load(manifests.runner_configmap(NAME, NAMESPACE, OWNER, s)["data"]["spec.yaml"])
    assert document["spec"]["model"]["tokenizer"] == "/models/kimi-k2.5"
    assert document["spec"]["model"]["path"] == "pvc://weights/kimi-k2.5"


# ------------------------------------------------------------------------------------ ownership and naming


def test_owner_reference_and_labels_on_every_object():
    assert OWNER == {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "name": NAME, "uid": UID,
                     "controller": True, "blockOwnerDeletion": True}
    for obj in all_children():
        meta = obj["metadata"]
        assert meta["ownerReferences"] == [OWNER], obj["kind"]
        assert meta["namespace"] == NAMESPACE
        assert meta["labels"]["app.kubernetes.io/name"] == "tokenmill"
        assert meta["labels"]["app.kubernetes.io/instance"] == NAME
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "tokenmill-operator"
        assert meta["labels"]["tokenmill.io/dataset-generation"] == NAME
        assert meta["labels"]["app.kubernetes.io/component"] in ("server", "runner")
        assert "team" not in meta["labels"]
        assert meta["labels"]["app.kubernetes.io/instance"] != CR_LABELS["app.kubernetes.io/instance"]
        template = obj.get("spec", {}).get("template")
        if template:
            assert template["metadata"]["labels"] == meta["labels"]


def test_child_names():
    assert names.server_name(NAME) == "b5-openthoughts-server"
    assert names.api_key_secret_name(NAME) == "b5-openthoughts-server-key"
    assert names.network_policy_name(NAME) == "b5-openthoughts-server"
    assert names.runner_name(NAME) == names.runner_configmap_name(NAME) == "b5-openthoughts-runner"


def test_long_names_are_truncated_with_a_hash():
    long = "a" * 40 + "-" + "b" * 60
    other = "a" * 40 + "-" + "b" * 59 + "c"
    for make in (names.server_name, names.api_key_secret_name, names.runner_name, names.network_policy_name):
        assert len(make(long)) <= 63
        assert make(long) != make(other)
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", make(long))
    # Room for the StatefulSet's controller-revision-hash label and the Indexed Job's pod hostnames.
    assert len(names.server_name(long)) <= 52 and len(names.runner_name(long)) <= 52
    assert names.server_name(long).endswith("-server")
    for value in names.labels(long, "server").values():
        assert len(value) <= 63
    host = names.server_pod_host(long, NAMESPACE, 7).split(".")[0]
    assert len(host) <= 63


def test_names_that_are_not_dns_labels_are_cleaned_up():
    assert re.fullmatch(r"[a-z][-a-z0-9]*", names.server_name("b5.openthoughts"))
    assert names.server_name("b5.openthoughts") != names.server_name("b5-openthoughts")
    assert names.server_name("5b")[0].isalpha()


def test_long_name_children_are_consistent():
    long = "x" * 70
    s = spec()
    sts = manifests.server_statefulset(long, NAMESPACE, OWNER, s, plan())
    service = manifests.server_service(long, NAMESPACE, OWNER, s)
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    j = manifests.runner_job(long, NAMESPACE, OWNER, s, "img", names.server_urls(long, NAMESPACE, 30000, 1))
    assert volume(j, "config")["configMap"]["name"] == manifests.runner_configmap(long, NAMESPACE, OWNER, s)[
        "metadata"]["name"]
    assert names.api_key_secret_name(long) in yaml.safe_dump(j)
    assert all(len(v) <= 63 for v in sts["spec"]["template"]["metadata"]["labels"].values())


def test_hidden_states_add_the_aux_capture_flags_of_0_5_23():
    # --enable-return-aux-hidden-states with --speculative-algorithm EAGLE3 as the convention, no draft (0.5.23
    # arg_groups/fields/exec_.py:130-157, arg_groups/validation_hook.py:697-752); explicit ids only when given.
    assert "--enable-return-aux-hidden-states" not in container(statefulset())["args"]
    args = container(statefulset(spec(hiddenStates__convention="eagle3")))["args"]
    assert flag(args, "--speculative-algorithm") == "EAGLE3"
    assert "--enable-return-aux-hidden-states" in args and "--return-aux-hidden-state-layer-ids" not in args
    args = container(statefulset(spec(hiddenStates__layerIds=[2, 30, 57])))["args"]
    at = args.index("--return-aux-hidden-state-layer-ids")
    assert args[at + 1:at + 4] == ["2", "30", "57"]
    assert args[-2:] == ["--chunked-prefill-size", "4096"]  # extraArgs still last
