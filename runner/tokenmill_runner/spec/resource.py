"""The DatasetGeneration resource as pydantic models: the one source of truth.

`tokenmill run SPEC.yaml` reads these models, the operator imports them, and the CRD in `crds/` is generated from
them. Field names are the Kubernetes (camelCase) names; Python attributes are snake_case.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from ..facts.hidden_states import (
    AUX_LAST_LAYOUTS,
    FINAL_PASS_LAYOUTS,
    FINAL_STATE_WITH_AUX_FROM,
    TRAINER_LAYOUTS,
    check_aux_last_layer_ids,
    check_layer_ids,
)
from ..facts.releases import (
    DEFAULT_IMAGE,
    DEFAULT_RELEASE,
    OLDEST_SUPPORTED,
    RELEASES,
    UnknownReleaseError,
    is_moving_tag,
    release,
    release_of_image,
    version_key,
)
from ..source.adapters import RowLayout
from ..store.bounds import DATASET_NAME, MAX_DATASETS

API_VERSION: Final = "tokenmill.io/v1alpha1"
KIND: Final = "DatasetGeneration"

Auto = Literal["auto"]


def _number_to_string(value: Any) -> Any:
    """Refuse a bare number where the resource keeps a decimal as a string. Users write `temperature: 0.6`, but the
    CRD types these fields as strings (the Kubernetes API conventions keep decimals out of floats, and a structural
    schema cannot say "a number or a string" without dropping the type altogether), so `kubectl apply` refuses the
    number: `tokenmill run` refuses it too, at once and with the fix, so one spec works on both paths."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        raise ValueError(f"write the number as a quoted string, \"{value}\" (not {value}): a DatasetGeneration keeps "
                         "decimals as strings, the Kubernetes way, and the CRD refuses a bare number")
    return value


def _parse_decimal(value: str) -> str:
    try:
        float(value)
    except ValueError:
        raise ValueError(f"must be a decimal number written as a string, e.g. \"0.6\"; got {value!r}") from None
    return value


def _fraction(value: str) -> str:
    number = float(_parse_decimal(value))
    if not 0.0 < number < 1.0:
        raise ValueError(f"must be a fraction strictly between 0 and 1, e.g. \"0.05\"; got {value!r}")
    return value


def _checked(value: str | None, name: str, ok: Callable[[float], bool], expected: str) -> str | None:
    if value is not None and not ok(float(value)):
        raise ValueError(f"must be {expected}, got {value}; SGLang refuses {name}={value} with HTTP 400, so every "
                         "sample would fail")
    return value


DecimalString = Annotated[str, BeforeValidator(_number_to_string), AfterValidator(_parse_decimal)]
FractionString = Annotated[str, BeforeValidator(_number_to_string), AfterValidator(_fraction)]

# S3 stores keys literally, but a store or proxy that normalises dot segments, decodes %2F or %2E (%2e%2e is '..'
# once decoded) or collapses '//' would write elsewhere.
S3_PREFIX_ESCAPE = re.compile(r"/\.{1,2}(?:/|$)|%2[fFeE]|\\|[^:/]//")

# Upper bounds of the integer fields (docs/security.md): a spec asking for more is a typo or an attack, and each
# bound says what it protects. The CRD carries the same numbers (tokenmill_operator.crd; tests/unit/test_crd.py
# compares the two field by field).
MAX_TOKENS = 2**24  # 16M tokens: above any model's context; past int64 SGLang fails with a TypeError, late
MAX_SERVERS = 256  # the runner Job names one --server per replica; thousands would pass etcd's 1.5 MiB object limit
MAX_CONCURRENCY = 4096  # requests in flight per worker: each holds a queue slot, a task and its prompt's ids
MAX_SHARD_SAMPLES = 16384  # rows wait in the worker's memory until their shard commits
MAX_SHARD_SECONDS = 3600  # ... and a crashed worker redoes what it had not committed
MAX_TIMEOUT_SECONDS = 7 * 24 * 3600
# Token ids are int32, and SGLang keeps top-k in an int32 tensor (0.5.23 sampling/sampling_batch_info.py:147-149).
MAX_TOKEN_ID = 2**31 - 1

# Flags the operator sets (or must never let a resource set) on the SGLang command line. SGLang parses with a
# default argparse.ArgumentParser (0.5.23 server_args.py:679), which takes any unambiguous abbreviation (--api-ke,
# --hos), so every prefix of these is refused too; --config FILE (:683) could set any of them, and
# --trust-remote-code only follows spec.model.trustRemoteCode.
MANAGED_FLAGS = ("--model-path", "--model", "--tokenizer-path", "--host", "--port", "--tp-size", "--tp",
                 "--tensor-parallel-size", "--api-key", "--admin-api-key", "--nnodes", "--node-rank",
                 "--dist-init-addr", "--trust-remote-code", "--config")


def managed_flag(arg: str) -> str | None:
    """The managed flag `arg` sets or abbreviates (argparse reads "--a=b" and "--a b" alike), else None."""
    name = arg.split("=", 1)[0]
    if not name.startswith("--"):
        return None
    return next((flag for flag in MANAGED_FLAGS if flag.startswith(name)), None)


class SpecModel(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are errors (a typo must not be ignored)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class ReasoningSpec(SpecModel):
    end_token: str | None = Field(
        "</think>",
        description="Token that ends the reasoning part of an output; looked up in the tokenizer, never by id. "
        "null for a model without reasoning.",
    )
    end_tokens: list[str] | None = Field(
        None, min_length=1,
        description="Every token that ends reasoning, first match wins (e.g. Kimi-K2.5 leaves reasoning at "
        "<|tool_calls_section_begin|> without </think>). Default: endToken plus the known alternatives the "
        "tokenizer has (<|tool_calls_section_begin|> for Kimi, as SGLang's kimi_k2 reasoning parser accepts).",
    )

    def candidates(self) -> list[str]:
        """The tokens to look up, in order; alternatives not in the tokenizer are dropped when defaulted."""
        if self.end_tokens is not None:
            return list(self.end_tokens)
        return [] if self.end_token is None else [self.end_token]


# Kubernetes' hostPath refuses '..' (and the tenant no longer chooses it); a folder name here never starts with '.',
# so no dot segment passes. RE2-compatible: the CRD carries the same pattern.
HOST_PATH_PATTERN = r"^(/[A-Za-z0-9_-][A-Za-z0-9._-]*)+$"
CLAIM_SIZE_PATTERN = r"^[1-9][0-9]{0,3}(Gi|Ti)$"


class ModelCacheSpec(SpecModel):
    """Copy s3:// weights once instead of into every server pod on every start (docs/cluster.md)."""

    mode: Literal["sharedVolume", "nodeLocal"] = Field(
        description="sharedVolume: one PersistentVolumeClaim per model, filled once by a Job and mounted read-only "
        "by every server pod of every resource serving that model. nodeLocal: a host folder (local NVMe) filled "
        "once per node under a lock, checked against the model's digest before SGLang starts.")
    storage_class: str | None = Field(
        None, description="sharedVolume: the claim's storage class (default: the cluster's default class).")
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod"] = Field(
        "ReadWriteMany", description="sharedVolume: the claim's access mode. ReadWriteMany lets server pods on "
        "several nodes share it; ReadWriteOnce only serves pods on one node.")
    size: str | None = Field(
        None, pattern=CLAIM_SIZE_PATTERN, description="sharedVolume: the claim's size, a quantity in whole Gi or Ti "
        "(e.g. 700Gi, at most 9999Ti); default: the weights plus 10%, in whole GiB.")
    host_path: str | None = Field(
        None, pattern=HOST_PATH_PATTERN, max_length=255, description="Deprecated, kept so older resources stay "
        "readable: the node-local folder is the operator's setting (chart value operator.nodeCacheRoot), and a "
        "resource naming another folder is refused (NotAllowed). An absolute path without . or .. segments.")


class ModelSpec(SpecModel):
    path: str = Field(
        description="Model location: s3://bucket/prefix/, pvc://claim/path, a Hugging Face id, or (local runs) a folder."
    )
    tokenizer: str | None = Field(None, description="Tokenizer location; defaults to the model path.")
    trust_remote_code: bool = Field(False, description="Allow the tokenizer's and model's own Python code to run.")
    reasoning: ReasoningSpec = Field(default_factory=ReasoningSpec, description="How reasoning is delimited.")
    weight_bytes: int | None = Field(
        None, gt=0, le=2**50,
        description="Total weight size in bytes; default: model.safetensors.index.json total_size at the model path.",
    )
    tool_call_token: str | None = Field(
        None,
        description="Token that opens a tool call in outputs; defaults to the first known one the tokenizer has "
        "(<|tool_calls_section_begin|>, <tool_call>, <｜tool▁calls▁begin｜>).",
    )
    cache: ModelCacheSpec | None = Field(
        None, description="Copy s3:// weights once (a shared volume or each node's disk) instead of into every "
        "server pod on every start. Only for an s3:// path.")

    @model_validator(mode="after")
    def _cache_needs_s3(self) -> ModelSpec:
        if self.cache is not None and not self.path.startswith("s3://"):
            raise ValueError(f"cache: only s3:// weights are copied, and model.path is {self.path!r}; a pvc:// "
                             "volume is already filled and a Hugging Face id is downloaded by SGLang: remove cache")
        return self


class SamplingSpec(SpecModel):
    """Sampling parameters sent to SGLang's /generate. Unset fields fall back to the spec-level defaults."""

    max_new_tokens: int | None = Field(
        None, gt=0, le=MAX_TOKENS, description="Output token cap. SGLang's own default (128) silently truncates "
        f"reasoning. At most {MAX_TOKENS} (above any context length; it must fit the context with the prompt)."
    )
    temperature: DecimalString | None = Field(
        None, description="Sampling temperature >= 0 as a string, e.g. \"0.6\" (0 = greedy).")
    top_p: DecimalString | None = Field(None, description="Nucleus sampling mass in (0, 1], as a string.")
    top_k: int | None = Field(None, le=MAX_TOKEN_ID, description="Top-k: -1 for the whole vocabulary, else "
                              "at least 1 (at most 2^31-1: SGLang holds it in an int32 tensor).")
    min_p: DecimalString | None = Field(None, description="Min-p in [0, 1], as a string.")
    repetition_penalty: DecimalString | None = Field(None, description="Repetition penalty in (0, 2], as a string.")
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]] | None = Field(
        None, max_length=64, description="Extra stop token ids besides the model's EOS (token ids are int32).")

    # SGLang's SamplingParams.verify answers HTTP 400 to values outside these ranges, so every sample of the
    # dataset would fail as server_rejected after the GPUs are up: refuse them here. Ranges are the intersection
    # over the supported releases (sampling/sampling_params.py:257-277 in 0.5.23; repetition_penalty 0 is refused
    # from 0.5.12.post1, so it is refused for all).
    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: str | None) -> str | None:
        return _checked(value, "temperature", lambda x: x >= 0 and math.isfinite(x), "a finite number >= 0")

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value: str | None) -> str | None:
        return _checked(value, "top_p", lambda x: 0 < x <= 1, "in (0, 1]")

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, value: str | None) -> str | None:
        return _checked(value, "min_p", lambda x: 0 <= x <= 1, "in [0, 1]")

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty(cls, value: str | None) -> str | None:
        return _checked(value, "repetition_penalty", lambda x: 0 < x <= 2, "in (0, 2] (1.0 = no penalty)")

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and value != -1 and value < 1:
            raise ValueError(f"must be -1 (the whole vocabulary) or at least 1, got {value}; SGLang refuses it "
                             "with HTTP 400")
        return value

    def merged_over(self, defaults: SamplingSpec) -> SamplingSpec:
        """This dataset's values where set, the defaults elsewhere."""
        own = self.model_dump(exclude_none=True)
        return defaults.model_copy(update=own)

    def to_sglang(self) -> dict[str, Any]:
        """The `sampling_params` object of a /generate request."""
        params: dict[str, Any] = {"max_new_tokens": self.max_new_tokens}
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                params[name] = float(value)
        if self.top_k is not None:
            params["top_k"] = self.top_k
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        return params


class DefaultSamplingSpec(SamplingSpec):
    # Never None: a request without max_new_tokens gets SGLang's 128 and silently truncates reasoning.
    max_new_tokens: int = Field(
        10240, gt=0, le=MAX_TOKENS, description="Output token cap for every dataset that does not set its own "
        f"(at most {MAX_TOKENS})."
    )


InputFormat = Literal["auto", "messages", "sharegpt", "openai", "prompt"]
MAX_SAMPLES = 64


class InputFieldsSpec(SpecModel):
    """Which column of a row holds what (`prompts.py` reads rows through this mapping)."""

    messages: str | None = Field(
        None, min_length=1, description="Column of the conversation: OpenAI messages, or ShareGPT turns. Default: messages "
        "(conversations for input.format sharegpt; auto looks for messages, then conversations).")
    prompt: str = Field("prompt", min_length=1, description="Column of a plain prompt string (input.format prompt).")
    system: str = Field("system", min_length=1, description="Column of an optional system prompt, put before the conversation "
                        "when it has no system message of its own.")
    id: str = Field("sample_id", min_length=1, description="Column of the sample id (rows without one are named by their line).")
    tools: str = Field("tools", min_length=1, description="Column of the tool schemas (a list, or a JSON string of one).")


class InputSpec(SpecModel):
    """How a row becomes the OpenAI messages the chat template renders."""

    format: InputFormat = Field(
        "auto", description="messages (OpenAI messages, string content), openai (messages whose content may be a "
        "list of text parts), sharegpt (turns with from/value), prompt (one string: a single user turn), or auto "
        "(per row: messages/openai, else ShareGPT conversations, else prompt).")
    fields: InputFieldsSpec = Field(default_factory=InputFieldsSpec, description="Column names, when not the "
                                    "defaults.")


class DatasetSpec(SpecModel):
    name: str = Field(description="Dataset name; also its folder under the output URI.")
    source: str = Field(description="Prompt rows: a .jsonl or .parquet file, or a folder of .parquet shards (a "
                        "Hugging Face dataset folder: *.parquet or data/*.parquet), local or s3://.")
    format: Literal["auto", "jsonl", "parquet"] = Field(
        "auto", description="File format; auto picks by the file extension (.parquet, else JSONL; a folder is "
        "Parquet)."
    )
    input: InputSpec = Field(default_factory=InputSpec, description="Row layout (ShareGPT, OpenAI, prompt) and the "
                             "column names.")
    samples: int = Field(1, ge=1, le=MAX_SAMPLES, description="Samples generated per prompt, each with its own seed; "
                         "(line, sample index) is each sample's identity.")
    limit: int | None = Field(None, gt=0, le=2**40, description="Use only the first N rows of the source.")
    sampling: SamplingSpec = Field(default_factory=SamplingSpec, description="Overrides of the default sampling.")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Chat template arguments for this dataset (e.g. thinking: false for Kimi, enable_thinking for "
        "Qwen3, reasoning_effort for GPT-OSS), merged over spec.chatTemplateKwargs key by key.",
    )
    mode: Literal["last-turn", "all-turns"] = Field(
        "last-turn",
        description="last-turn: one answer to each row's messages as given. all-turns: every assistant turn is "
        "regenerated in order, each the model's own answer to the history so far (user and system messages "
        "replayed, the model's earlier answers in the history, the source's tool results spliced back when the "
        "model calls the tool the source called, the conversation stopped where it diverges); one row per "
        "conversation with each turn's prompt and output ids.",
    )

    def row_layout(self) -> RowLayout:
        fields = self.input.fields
        return RowLayout(format=self.input.format, messages=fields.messages, prompt=fields.prompt,
                         system=fields.system, id=fields.id, tools=fields.tools)

    @field_validator("name")
    @classmethod
    def _name_is_a_folder_name(cls, value: str) -> str:
        if not DATASET_NAME.fullmatch(value):
            raise ValueError(
                f"dataset name {value!r} must be 1-63 letters, digits, '_', '.' or '-' (it names a folder)"
            )
        return value


# Every --kv-cache-dtype value some known SGLang release accepts (releases.py); the release in use is checked below.
KV_CACHE_DTYPES: tuple[str, ...] = tuple(dict.fromkeys(d for r in RELEASES.values() for d in r.kv_cache_dtypes))
KvCacheDtype = Literal[KV_CACHE_DTYPES]  # type: ignore[valid-type]


class ServerSpec(SpecModel):
    """How the operator runs SGLang; `tokenmill run` uses only contextLength from here."""

    image: str = Field(DEFAULT_IMAGE, description=f"SGLang image; tokenmill supports releases {OLDEST_SUPPORTED} to "
                       f"{DEFAULT_RELEASE} (the default; {OLDEST_SUPPORTED} is the first that serves Kimi-K2.5). The "
                       "release is read from the tag (lmsysorg/sglang:v0.5.23, v0.5.19-cu129, v0.5.9-rocm700-mi30x).")
    sglang_version: str | None = Field(
        None, description="SGLang release of a custom image whose tag names none (e.g. 0.5.23): the checks and the "
        "plan follow that release's facts. Default: the image tag's release, else the default release.",
    )
    gpus_per_node: int = Field(8, gt=0, le=64, description="GPUs per node (at most 64).")
    gpu_product: str | None = Field(
        None, description="GPU product: the node label value (nvidia.com/gpu.product, e.g. NVIDIA-H200 or "
        "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition; amd.com/gpu.product-name for AMD) or a short name (H200, "
        "RTX-PRO-6000, MI300X).",
    )
    gpu_memory_mib: int | None = Field(
        None, gt=0, le=2**22, description="Memory of one GPU in MiB; default: known from gpuProduct (e.g. "
        "NVIDIA-H200: 143771). At most 4 TiB."
    )
    cuda_driver_major: int | None = Field(
        None, gt=0, le=10_000, description="NVIDIA driver branch of the GPU nodes (e.g. 570, 580), as GPU feature discovery labels "
        "them (nvidia.com/cuda.driver.major); default: read from the nodes by the operator. An image whose CUDA the "
        "driver cannot run (CUDA 13 needs 580+, CUDA 12 525+) is swapped for its -cu129 tag or refused at plan time.",
    )
    nodes: Annotated[int, Field(ge=1, le=MAX_SERVERS)] | Auto = Field(
        "auto", description="Nodes the run may use (each with gpusPerNode GPUs); auto: the fewest one replica needs. "
        f"The planner lays out replicas on them for the fastest finish. At most {MAX_SERVERS}: every server pod "
        "is named in the runner Job, whose size etcd limits.",
    )
    replicas: Annotated[int, Field(ge=1, le=MAX_SERVERS)] | Auto = Field(
        "auto", description="Independent server replicas, or auto (as many as the nodes hold). At most "
        f"{MAX_SERVERS}: the runner Job names one --server per replica, and etcd limits an object to 1.5 MiB.")
    tensor_parallel: Annotated[int, Field(ge=1, le=64)] | Auto = Field(
        "auto", description="Tensor-parallel size per replica (1-64), or auto.")
    attention_data_parallel: Annotated[int, Field(ge=1, le=64)] | Auto = Field(
        "auto", description="DP attention groups per replica (1 = off; SGLang --enable-dp-attention / "
        "--attn-dp-size), or auto: tried for MLA models, whose KV TP would otherwise copy to every rank.",
    )
    mem_fraction_static: FractionString | Auto = Field("auto", description="--mem-fraction-static, or auto.")
    context_length: Annotated[int, Field(ge=1, le=MAX_TOKENS)] | Auto = Field(
        "auto", description="Context length, or auto (what SGLang derives from config.json; it refuses more). At "
        f"most {MAX_TOKENS}.")
    max_running_requests: Annotated[int, Field(ge=1, le=2**20)] | Auto = Field(
        "auto", description="--max-running-requests, or auto (at most 2^20).")
    kv_cache_dtype: KvCacheDtype = Field(
        "auto", description="--kv-cache-dtype; auto keeps the model's 16-bit dtype. The values the SGLang release "
        "in use accepts (mxfp8, nvfp4, fp4_mx_block16 from 0.5.16; fp4_e2m1 until 0.5.20).",
    )
    port: int = Field(30000, gt=0, lt=65536, description="SGLang HTTP port (/generate, /health, /metrics).")
    start_deadline_seconds: int | None = Field(
        None, gt=0, le=7 * 86400, description="A server that is not ready this long after the operator started it "
        "(an image that cannot be pulled, a container in CrashLoopBackOff, pods that cannot be scheduled) ends the "
        "run Failed with ServerCannotStart and the server scaled to zero, so its GPUs are not held for ever; "
        "default: three times the plan's predicted start-up (weights' copy, load, CUDA graphs, warmup), at least "
        "1800 s and at least the startup probe's budget. Editing the spec starts the server again.",
    )
    verify_window_seconds: int = Field(
        600, ge=1, le=86400, description="The plan's check on the GPUs (docs/planning.md): this long after the "
        "server first runs requests, the operator compares the batch and decode step SGLang reports on /metrics "
        "with the plan's and records the PlanVerified condition (False, reason PlanOff, past 15 %).",
    )
    replan: Literal["auto", "suggest", "off"] = Field(
        "suggest", description="After the plan's check, the operator re-plans with the constants it measured and "
        "compares, on the remaining samples, the running layout with every other layout the spec allows. A switch "
        "pays a restart (the plan's start-up: copy, load, warm-up) plus a margin (5 % of the remaining time, at "
        "least 10 minutes). auto: when the best other layout's remaining ETA beats the running one's by more than "
        "that, the operator switches the server to it (status.layoutOverride, the Replanned condition and an "
        "Event), replaces the runner Job and the run resumes from what is committed; at most once per spec "
        "generation, and an edit of the spec plans from the spec again. suggest: it says so in the "
        "ReplanSuggested condition and an Event (setting spec.server.tensorParallel switches). off: no re-plan.",
    )
    trial: Literal["auto", "off"] = Field(
        "off", description="A measured trial for long jobs (docs/planning.md, 4d): auto: when the plan's closest "
        "candidates cannot be told apart by its intervals and the trial fits in 5 % of the predicted ETA, the "
        "operator runs them one after another (the server in each layout, the runner Job replaced, resuming from "
        "what is committed), measures each one's steady throughput on SGLang's /metrics, and continues on the "
        "fastest (status.trial, the Trialled condition and an Event). The trial counts as the generation's layout "
        "switch: replan auto only suggests after it. off: no trial.",
    )
    startup_timeout_seconds: int | None = Field(
        None, gt=0, le=MAX_TIMEOUT_SECONDS, description="How long a server may load weights before its startup probe "
        "fails it (at most a week); default: three times the plan's predicted load (weights, CUDA graphs, warmup), "
        "at least 1800 s.",
    )
    shm_size: str = Field(
        "64Gi", pattern=r"^[1-9][0-9]{0,3}Gi$", description="Size of the in-memory /dev/shm volume (NCCL needs a large "
        "one), in whole Gi up to 9999Gi. It is charged to the pod's memory, so the server pod requests at least "
        "this much memory.")
    deterministic_inference: bool = Field(
        False, description="Start SGLang with --enable-deterministic-inference so each sample's seed makes its "
        "sampling reproducible; it switches to batch-invariant kernels and the pytorch sampler (slower).")
    extra_args: list[str] = Field(
        default_factory=list, description="Extra SGLang flags, appended verbatim. Not the flags the operator "
        f"manages, nor any abbreviation of one (SGLang's argparse accepts --api-ke for --api-key): "
        f"{', '.join(MANAGED_FLAGS)}; use the spec fields instead.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Extra node selector for server pods.")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="Extra tolerations.")
    resources: dict[str, Any] = Field(default_factory=dict, description="Extra container resources.")

    @field_validator("extra_args")
    @classmethod
    def _no_managed_flag(cls, value: list[str]) -> list[str]:
        for index, arg in enumerate(value):
            if flag := managed_flag(arg):
                raise ValueError(f"[{index}] {arg.split('=')[0]!r} sets (or abbreviates) {flag}, which the operator "
                                 "manages: use the spec field instead (model, server, trustRemoteCode)")
        return value

    @field_validator("sglang_version")
    @classmethod
    def _known_release(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                release(value)
            except UnknownReleaseError as error:
                raise ValueError(str(error)) from None
        return value

    def release_version(self) -> str | None:
        """The SGLang release the image runs: sglangVersion when set, else the image tag's, else None."""
        return self.sglang_version or release_of_image(self.image)

    @model_validator(mode="after")
    def _moving_tag_needs_a_release(self) -> ServerSpec:
        if self.sglang_version is None and is_moving_tag(self.image):
            raise ValueError(
                f"image {self.image}: the tag moves to each new SGLang build, so tokenmill cannot tell which release's "
                f"flags and rules apply (and they change in almost every release): pin a release tag such as "
                f"{DEFAULT_IMAGE}, or set sglangVersion to the release the tag runs")
        return self

    @model_validator(mode="after")
    def _kv_cache_dtype_of_the_release(self) -> ServerSpec:
        version = self.release_version()
        if version is None or self.kv_cache_dtype == "auto":
            return self
        try:
            facts = release(version)
        except UnknownReleaseError:
            return self  # an image tag naming an unknown release: the planner says so
        if self.kv_cache_dtype not in facts.kv_cache_dtypes:
            raise ValueError(
                f"kvCacheDtype {self.kv_cache_dtype!r}: SGLang {facts.version} ({self.image}) does not accept it; its "
                f"argument parser exits before loading anything and the pod restarts forever. It accepts "
                f"{', '.join(facts.kv_cache_dtypes)}")
        return self


class RunnerSpec(SpecModel):
    image: str | None = Field(None, description="Runner image; defaults to the operator's own version.")
    parallelism: int = Field(1, gt=0, le=256, description="Runner workers (Indexed Job completions); samples split by "
                             "id. At most 256.")
    concurrency: Annotated[int, Field(ge=1, le=MAX_CONCURRENCY)] | Auto = Field(
        "auto", description="Requests in flight per worker; auto = what the servers run at once plus half again "
        f"as a queue, split over the workers. At most {MAX_CONCURRENCY} (what auto is capped at): each request in "
        "flight holds a queue slot, a task and its prompt's token ids in the worker's memory.",
    )
    shard_max_samples: int = Field(
        256, gt=0, le=MAX_SHARD_SAMPLES, description="Commit a shard when it holds this many samples. At most "
        f"{MAX_SHARD_SAMPLES}: rows wait in the worker's memory until their shard commits.")
    shard_max_seconds: int = Field(
        60, gt=0, le=MAX_SHARD_SECONDS, description="Commit a shard at least this often (seconds). At most "
        f"{MAX_SHARD_SECONDS}: rows wait in memory until then, and a crashed worker redoes them.")
    max_attempts: int = Field(
        6, gt=0, le=100,
        description="Failed attempts per sample before it is recorded as failed. Only failures plausibly "
        "the sample's own count (a corrupt answer, an abort, a server error while the replica answers others); "
        "while no server is live the runner waits without spending attempts. At most 100.",
    )
    outage_budget_seconds: int = Field(
        7200, gt=0, le=MAX_TIMEOUT_SECONDS,
        description="How long the runner waits for a live server when every replica is down before it stops "
        "(exit code 4; nothing is written off, a rerun or the restarted Job continues). The default is twice "
        "server.startupTimeoutSeconds' default: one full restart of a large model (weights copied again, loaded, "
        "warmed up) with room to spare.",
    )
    request_timeout_seconds: int = Field(3600, gt=0, le=MAX_TIMEOUT_SECONDS,
                                         description="Timeout of one /generate request (at most a week).")
    stall_seconds: int | None = Field(
        None, gt=0, le=MAX_TIMEOUT_SECONDS,
        description="Report Stalled (condition, Event, alert) when nothing is committed for this long; default: "
        "the operator's setting (15 minutes). Longer than the slowest expected request.",
    )
    start_deadline_seconds: int = Field(
        1800, gt=0, le=7 * 86400,
        description="Runner pods that cannot start for this long (image pull errors, unschedulable for CPU or "
        "memory) end the run Failed with RunnerCannotStart and the server scaled to zero, so the GPUs are not held "
        "for runners that never come; fix the cause (spec.runner.image, quotas) and the run starts again.",
    )
    retry_failed: bool = Field(
        False,
        description="Run with --retry-failed: samples given up for a retryable reason (retries exhausted, bad "
        "answers) are tried again each time a runner starts. To retry once after a run ended, set the annotation "
        "tokenmill.io/retry-failed to a new value instead.",
    )


class OutputSpec(SpecModel):
    uri: str = Field(description="Where shards, commit markers, errors and the report go: s3://bucket/prefix/ or a folder.")
    endpoint: str | None = Field(None, description="S3 endpoint URL for S3-compatible stores.")
    region: str | None = Field(None, description="S3 region.")
    credentials_secret: str | None = Field(
        None, description="Secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for S3 (cluster runs)."
    )
    allow_unconditional_writes: bool = Field(
        False, description="Run on a store that ignores conditional PutObject (If-None-Match / If-Match), which the "
                           "output lease needs to keep a second writer out. Risk: two runs started at the same moment "
                           "can both write, committing samples twice and deleting each other's unmarked shards.")

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, value: str) -> str:
        if "://" in value and not value.startswith(("s3://", "file://")):
            raise ValueError(f"output uri {value!r}: use s3://bucket/prefix/ or a local folder")
        if value.startswith("s3://") and S3_PREFIX_ESCAPE.search(value):
            raise ValueError(f"output uri {value!r}: a '.' or '..' segment, an empty segment ('//'), or an encoded "
                             "slash or dot (%2F, %2E) could leave the prefix on a store or proxy that normalises "
                             "keys; name the prefix plainly")
        return value


ExportLayout = Literal["speculators", "specforge"]
# Flags whose value SGLang reads as the pipeline-parallel size (argparse also takes unambiguous abbreviations).
_PP_FLAGS = ("--pp-size", "--pipeline-parallel-size")


class HiddenStatesSpec(SpecModel):
    """The target's EAGLE-3 aux hidden states captured for every committed sample (SGLang 0.5.23+)."""

    convention: Literal["eagle3"] = Field(
        "eagle3", description="Capture convention: eagle3 (SGLang --speculative-algorithm EAGLE3 names it; no draft "
        "is loaded).")
    layer_ids: list[Annotated[int, Field(ge=0, le=100_000)]] | None = Field(
        None, max_length=64, description="Target layer ids whose outputs are captured "
        "(--return-aux-hidden-state-layer-ids); default: SGLang's EAGLE3 layers for the architecture (the inputs "
        "of layers 2, L/2 and L-3, i.e. the outputs of layers 1, L/2-1, L-4).")
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="The dtype the target serves (its config.json torch_dtype); states are stored in it "
        "exactly as served unless storage is fp8.")
    storage: Literal["served", "fp8"] = Field(
        "served", description="How the states are stored: served (bit-exact in dtype) or fp8 (hs-connectors 0.9.0's "
        "fp8 layout: float8_e4m3fn values with one float32 scale per token, hidden_states_scales, in the same file; "
        "about half of bf16's bytes; speculators trains on it with --hidden-states-backend fp8). Not with the "
        "specforge layout: SpecForge 0.2.0 reads its .ckpt tensors as stored and has no FP8 reader.")
    layouts: list[ExportLayout] = Field(
        default_factory=list, max_length=2,
        description="Trainer layouts wanted besides tokenmill's own files (a safetensors file per sample: token_ids "
        "and the aux layers): specforge (SpecForge's offline .ckpt files, `tokenmill export --format "
        "specforge-offline`), whose final hidden state a second pass captures from the server relaunched with "
        "--enable-return-hidden-states (the operator runs both passes; `tokenmill run` twice by hand); speculators (its Arrow "
        "dataset and hidden_states/hs_{i}.safetensors, `tokenmill export --format speculators-offline`), whose "
        "pre-norm final state SGLang 0.5.23 serves only for GptOssForCausalLM, as the last aux layer: set layerIds "
        "[1, L/2-1, L-4, L-1] (L = num_hidden_layers; docs/export.md).")

    @field_validator("layer_ids")
    @classmethod
    def _sglang_rules(cls, value: list[int] | None) -> list[int] | None:
        if value is not None:
            check_layer_ids(value, num_layers=100_001)  # the model's own count is checked by the planner
        return value

    @field_validator("layouts")
    @classmethod
    def _unique_layouts(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"layouts {value} name a layout twice")
        return value

    @model_validator(mode="after")
    def _fp8_readers(self) -> HiddenStatesSpec:
        if self.storage == "fp8" and "specforge" in self.layouts:
            raise ValueError("storage fp8 cannot serve layouts [specforge]: SpecForge 0.2.0 reads its .ckpt tensors as "
                             "stored (specforge/data/preprocessing.py:643-666) and has no FP8 reader; store served "
                             "or drop the layout")
        return self


class ValidationSpec(SpecModel):
    max_truncated_fraction: FractionString = Field(
        "0.05", description="Most samples that may hit max_new_tokens before the report warns."
    )
    min_reasoning_fraction: FractionString = Field(
        "0.9", description="Fewest samples that must contain the end-of-reasoning token."
    )
    max_error_fraction: FractionString = Field("0.01", description="Most samples that may fail.")


class DatasetGenerationSpec(SpecModel):
    """Generate outputs of one model for every prompt of a list of datasets."""

    model: ModelSpec = Field(description="The target model and its tokenizer.")
    server: ServerSpec = Field(default_factory=ServerSpec, description="How SGLang is run (cluster runs).")
    sampling: DefaultSamplingSpec = Field(
        default_factory=DefaultSamplingSpec, description="Sampling defaults for every dataset."
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Chat template arguments for every dataset, passed to the model's chat template (and its "
        "remote code) when prompts are tokenized; recorded in run.json.",
    )
    datasets: list[DatasetSpec] = Field(min_length=1, max_length=MAX_DATASETS, description="The prompt datasets, "
                                        "processed as one stream (at most 64: each is a folder, a ledger and a "
                                        "report section in every reader of the output).")
    runner: RunnerSpec = Field(default_factory=RunnerSpec, description="The runner workers.")
    output: OutputSpec = Field(description="Where the shards and the report go.")
    validation: ValidationSpec = Field(
        default_factory=ValidationSpec, description="Thresholds of the validation report's checks."
    )
    hidden_states: HiddenStatesSpec | None = Field(
        None, description="Capture the target's EAGLE-3 aux hidden states of every committed sample (prompt + "
        "output ids), stored beside the shards; off when unset. Needs SGLang 0.5.23+ and pipeline parallelism 1.")
    suspend: bool = Field(False, description="Scale everything to zero; resuming continues from what is committed.")
    seed: int | None = Field(
        None, ge=0, lt=2**63, description="Base of the per-sample seeds (default 0): each sample's seed is a hash of "
        "(seed, dataset, line, sample index), the same on every rerun. SGLang uses it only with "
        "server.deterministicInference; otherwise it is recorded but sampling is not reproducible.")

    @model_validator(mode="after")
    def _unique_dataset_names(self) -> DatasetGenerationSpec:
        seen: set[str] = set()
        for index, dataset in enumerate(self.datasets):
            if dataset.name in seen:
                raise ValueError(f"datasets[{index}].name {dataset.name!r} is used twice; names must be unique")
            seen.add(dataset.name)
        return self

    @model_validator(mode="after")
    def _hidden_states_servable(self) -> DatasetGenerationSpec:
        if self.hidden_states is None:
            return self
        version = self.server.release_version() or DEFAULT_RELEASE
        try:
            facts = release(version)
        except UnknownReleaseError:
            return self  # the planner names the unknown release
        if not facts.aux_hidden_states:
            raise ValueError(
                f"hiddenStates: SGLang {facts.version} ({self.server.image}) cannot capture aux hidden states: "
                "--enable-return-aux-hidden-states first ships in 0.5.23 (earlier releases return only the last "
                "layer); use lmsysorg/sglang:v0.5.23 or later")
        for index, layout in enumerate(self.hidden_states.layouts):
            if layout in FINAL_PASS_LAYOUTS:
                continue  # its final state comes from a second pass (facts/hidden_states.py)
            if layout in AUX_LAST_LAYOUTS:
                # Its final state is the last aux layer; the architecture and L are checked against config.json
                # by the planner and the runner (facts/hidden_states.check_layouts).
                try:
                    check_aux_last_layer_ids(layout, self.hidden_states.layer_ids)
                except ValueError as error:
                    raise ValueError(f"hiddenStates.{error}") from None
                continue
            if FINAL_STATE_WITH_AUX_FROM is None or version_key(facts.version) < version_key(FINAL_STATE_WITH_AUX_FROM):
                raise ValueError(
                    f"hiddenStates.layouts[{index}] {layout!r}: {TRAINER_LAYOUTS[layout]}, and SGLang {facts.version} "
                    "returns the aux layers in place of the final hidden state (no release serves both); drop the "
                    "layout: the states are stored as token_ids + aux layers per sample")
        args = self.server.extra_args
        for index, arg in enumerate(args):
            name, _, inline = arg.partition("=")
            if len(name) > 4 and any(flag.startswith(name) for flag in _PP_FLAGS):
                value = inline or (args[index + 1] if index + 1 < len(args) else "")
                if value.strip() != "1":
                    raise ValueError(
                        f"hiddenStates: server.extraArgs[{index}] {arg!r} sets pipeline parallelism {value!r}; SGLang "
                        "captures aux hidden states only with pp_size 1 (the hooks see only the last rank's layers)")
        return self

    def sampling_for(self, dataset: DatasetSpec) -> SamplingSpec:
        return dataset.sampling.merged_over(self.sampling)

    def chat_template_kwargs_for(self, dataset: DatasetSpec) -> dict[str, Any]:
        return {**self.chat_template_kwargs, **dataset.chat_template_kwargs}


    def identity_document(self) -> dict[str, Any]:
        """The spec as what runs from it depends on it: everything but `suspend` (suspending keeps a run as it is)
        and the operator's own checks of the plan (OPERATOR_ONLY: they change nothing the runner or SGLang does)."""
        document = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        document.pop("suspend", None)
        for name in OPERATOR_ONLY:
            document.get("server", {}).pop(name, None)
        return document


# spec.server fields only the operator reads, after the server runs: editing them neither restarts the server nor
# replaces the runner Job.
OPERATOR_ONLY = ("verifyWindowSeconds", "replan", "trial")


def content_hash(payload: Any) -> str:
    """16 hex digits of SHA-256 over the canonical JSON of `payload`: a spec's or a runner Job's identity."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


class ObjectMeta(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    namespace: str | None = None


class DatasetGeneration(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="forbid")
    api_version: Literal["tokenmill.io/v1alpha1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["DatasetGeneration"] = KIND
    metadata: ObjectMeta
    spec: DatasetGenerationSpec
    status: dict[str, Any] | None = None


class SpecError(ValueError):
    """A spec that cannot be used; the message names the file and the field."""


def _field_path(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts)


def format_validation_error(source: str, error: ValidationError) -> str:
    lines = [f"{source}: invalid DatasetGeneration"]
    for item in error.errors():
        lines.append(f"  {_field_path(item['loc'])}: {item['msg']}")
    return "\n".join(lines)


def parse_document(document: Any, source: str = "<spec>") -> DatasetGeneration:
    if not isinstance(document, dict):
        raise SpecError(f"{source}: expected a DatasetGeneration mapping, got {type(document).__name__}")
    try:
        return DatasetGeneration.model_validate(document)
    except ValidationError as error:
        raise SpecError(format_validation_error(source, error)) from None


# A spec is a few KB. YAML aliases share one object between every place that names it, so a 1 KB file of nested
# anchors (9 levels of 10 aliases) is a billion nodes once dumped for the spec hash, the ConfigMap or run.json:
# the nodes are counted as if every alias were expanded before anything is built.
MAX_SPEC_BYTES = 1024 * 1024
MAX_SPEC_NODES = 100_000


def _expanded_nodes(root: yaml.Node, source: str) -> int:
    """Nodes of the document with every alias expanded, counted once per distinct node (no expansion happens)."""
    counts: dict[int, int] = {}
    open_nodes: set[int] = set()

    def count(node: yaml.Node) -> int:
        key = id(node)
        if key in counts:
            return counts[key]
        if key in open_nodes:
            raise SpecError(f"{source}: a YAML anchor refers to itself; a spec cannot be recursive")
        open_nodes.add(key)
        total = 1
        if isinstance(node, yaml.MappingNode):
            total += sum(count(k) + count(v) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            total += sum(count(item) for item in node.value)
        total = min(total, MAX_SPEC_NODES + 1)  # past the cap the exact figure does not matter
        open_nodes.discard(key)
        counts[key] = total
        return total

    try:
        return count(root)
    except RecursionError:
        raise SpecError(f"{source}: the YAML is nested too deeply to be a spec") from None


def load_yaml_bounded(text: str, source: str) -> Any:
    """yaml.safe_load, refused (SpecError) past MAX_SPEC_BYTES or MAX_SPEC_NODES nodes with aliases expanded."""
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError(f"{source}: {len(text)} characters, over the {MAX_SPEC_BYTES} a spec may have")
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        expanded = _expanded_nodes(node, source)
        if expanded > MAX_SPEC_NODES:
            raise SpecError(f"{source}: its YAML aliases expand to over {MAX_SPEC_NODES} nodes (anchors nested "
                            "inside anchors); write the values out, a spec needs far fewer")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def load_spec_file(path: str | Path) -> DatasetGeneration:
    """Read a DatasetGeneration YAML file; relative local paths in it are resolved against its folder."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_SPEC_BYTES + 1)
        if len(raw) > MAX_SPEC_BYTES:
            raise SpecError(f"{path}: over the {MAX_SPEC_BYTES} bytes a spec may have")
        document = load_yaml_bounded(raw.decode("utf-8"), str(path))
    except UnicodeDecodeError as error:
        raise SpecError(f"{path}: not UTF-8 text ({error})") from None
    except OSError as error:
        raise SpecError(f"cannot read spec {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise SpecError(f"{path}: not valid YAML: {error}") from None
    resource = parse_document(document, str(path))
    return resolve_relative_paths(resource, path.resolve().parent)


def _resolve(value: str | None, base: Path, may_be_hub_id: bool = False) -> str | None:
    if value is None or "://" in value or value.startswith("/"):
        return value
    if may_be_hub_id and not value.startswith(("./", "../")) and not (base / value).exists():
        return value  # a Hugging Face id such as moonshotai/Kimi-K2.5
    return str((base / value).resolve())


def resolve_relative_paths(resource: DatasetGeneration, base: Path) -> DatasetGeneration:
    spec = resource.spec
    model = spec.model.model_copy(
        update={
            "path": _resolve(spec.model.path, base, may_be_hub_id=True),
            "tokenizer": _resolve(spec.model.tokenizer, base, may_be_hub_id=True),
        }
    )
    datasets = [d.model_copy(update={"source": _resolve(d.source, base)}) for d in spec.datasets]
    output = spec.output.model_copy(update={"uri": _resolve(spec.output.uri, base)})
    new_spec = spec.model_copy(update={"model": model, "datasets": datasets, "output": output})
    return resource.model_copy(update={"spec": new_spec})
