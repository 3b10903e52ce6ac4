"""What each SGLang release accepts and answers, as data. Pure: no I/O beyond reading this package's own data.

Every fact was read from that release's own wheel (`pip download sglang==X --no-deps`); the file:line of each is in
docs/sglang-release-facts.md. Facts are kept as change points (the first release that shows a behaviour), because
something tokenmill relies on changes in almost every minor line; `release(v)` resolves them for one release.

Supported: 0.5.9 (the first release that registers KimiK25ForConditionalGeneration) to 0.5.23 (the latest,
2026-10-30), the last patch of each minor line. 0.5.6 to 0.5.8.post1 are known but unsupported (they cannot serve
Kimi-K2.5), so the planner can say why instead of guessing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Literal

# (release, upload date): the last patch of every minor line that was read.
_RELEASES: tuple[tuple[str, str], ...] = (
    ("0.5.6", "2025-12-03"),
    ("0.5.6.post2", "2025-12-11"),
    ("0.5.7", "2026-01-01"),
    ("0.5.8", "2026-01-23"),
    ("0.5.8.post1", "2026-02-05"),
    ("0.5.9", "2026-02-23"),
    ("0.5.10.post1", "2026-04-08"),
    ("0.5.11", "2026-05-05"),
    ("0.5.12.post1", "2026-05-23"),
    ("0.5.13.post1", "2026-06-15"),
    ("0.5.14", "2026-06-26"),
    ("0.5.15.post1", "2026-07-14"),
    ("0.5.16", "2026-07-25"),
    ("0.5.17", "2026-08-08"),
    ("0.5.18", "2026-08-21"),
    ("0.5.19", "2026-09-04"),
    ("0.5.20", "2026-09-18"),
    ("0.5.21", "2026-10-01"),
    ("0.5.22", "2026-10-16"),
    ("0.5.23", "2026-10-30"),
)
OLDEST_SUPPORTED = "0.5.9"
DEFAULT_RELEASE = "0.5.23"
IMAGE_REPOSITORY = "lmsysorg/sglang"
DEFAULT_IMAGE = f"{IMAGE_REPOSITORY}:v{DEFAULT_RELEASE}"
# The last release with a CUDA 12 image (install docs: "v0.5.19-cu129 is the last CUDA 12 tag"); later images need a
# driver that supports CUDA 13.
LAST_CUDA12_RELEASE = "0.5.19"
# The oldest NVIDIA driver branch that runs each CUDA major line (minor version compatibility: NVIDIA's CUDA
# Compatibility guide, table 1: CUDA 13.x >= 580, CUDA 12.x >= 525). GPU feature discovery labels the branch as
# nvidia.com/cuda.driver.major (e.g. 570); nvidia.com/cuda.runtime.major is the CUDA line the driver supports.
MIN_DRIVER_BY_CUDA_MAJOR = {12: 525, 13: 580}
# SGLANG_HEALTH_CHECK_TIMEOUT's default: /health and /health_generate wait this long for a scheduler answer before
# they say 503 (0.5.9 entrypoints/http_server.py:166, 520; 0.5.23 entrypoints/http_server.py:218, 779).
HEALTH_CHECK_TIMEOUT_S = 20

_VERSION = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)(?:\.post(\d+))?$")
_IMAGE_TAG = re.compile(r":v?(\d+\.\d+\.\d+(?:\.post\d+)?)(?:-[A-Za-z0-9._-]+)?$")

# Tags SGLang moves to each new build (install docs: "latest ... always points at the newest stable release"; nightly
# and dev builds): no release can be read from them, and the one behind them changes without the spec changing.
MOVING_TAG_PATTERN = r":(latest|nightly|dev)([-.][A-Za-z0-9._-]*)?$"  # RE2 too: the CRD's CEL rule uses it
_MOVING_TAG = re.compile(MOVING_TAG_PATTERN)
_CUDA_SUFFIX = re.compile(r"-cu(\d\d)(\d)(?:-|$)")

VersionKey = tuple[int, int, int, int]


class UnknownReleaseError(ValueError):
    """A version tokenmill has no facts for."""


def version_key(version: str) -> VersionKey:
    match = _VERSION.match(version.strip())
    if not match:
        raise UnknownReleaseError(f"{version!r} is not an SGLang version such as 0.5.23 or 0.5.10.post1")
    major, minor, patch, post = match.groups()
    return int(major), int(minor), int(patch), int(post or 0)


def _at_least(version: str, first: str) -> bool:
    return version_key(version) >= version_key(first)


@dataclass(frozen=True)
class Release:
    """The facts of one SGLang release that tokenmill's spec checks, client, planner and simulator need."""

    version: str
    released: str
    supported: bool
    # --kv-cache-dtype choices (argparse exits with code 2 on any other value, before loading anything).
    kv_cache_dtypes: tuple[str, ...]
    # TokenizerManager refuses (HTTP 400) when prompt + max_new_tokens <op> context length.
    context_rule: Literal[">=", ">"]
    # meta_info key counting retractions of the request.
    retractions_key: Literal["total_retractions", "num_retractions"]
    has_reasoning_tokens: bool  # meta_info.reasoning_tokens
    has_cached_tokens_details: bool  # meta_info.cached_tokens_details
    # `return_prompt_token_ids: true` makes /generate echo the ids the scheduler got as `prompt_token_ids`
    # (0.5.13.post1 managers/io_struct.py, managers/tokenizer_manager.py:616-617, 1960-1961; 0.5.23
    # managers/tokenizer_manager.py:948-949, 2673-2674); earlier releases ignore the key.
    echoes_prompt_ids: bool
    # `routed_dp_rank` picks the data-parallel scheduler of a request (0.5.10.post1 managers/io_struct.py; 0.5.23
    # managers/io_struct.py:298, managers/tokenizer_manager.py:915-924: out of range is a 400); 0.5.9 names it
    # data_parallel_rank (0.5.9 managers/io_struct.py:240).
    routes_dp_rank: bool
    # finish_reason when EOS is sampled as the last allowed token: the length check ran first until 0.5.17.
    eos_at_cap: Literal["length", "stop"]
    # An unknown sampling_params key: TypeError -> HTTP 500 until 0.5.21; a JSON contract gate answers 400 after.
    unknown_sampling_key_status: Literal[500, 400]
    # Scheduler aborts that become HTTP errors (others come back as HTTP 200 with finish_reason.type "abort").
    abort_statuses_as_http: Literal["400/500/503", "400-599"]
    # DP attention is `--dp-size N --enable-dp-attention` until 0.5.21, `--attn-dp-size N` from 0.5.22.
    dp_attention_flag: Literal["--enable-dp-attention", "--attn-dp-size"]
    effective_max_running_per_dp: bool  # /server_info internal_states[*].effective_max_running_requests_per_dp
    # /server_info reports the resolution hooks' values and launch_command from 0.5.19; what __post_init__ computes
    # (mem_fraction_static) it reports in every release (0.5.9 entrypoints/http_server.py:605-610, server_args.py:1059)
    server_info_resolved: bool
    metric_engine_type_label: bool  # tokenizer metrics carry engine_type besides model_name
    metric_context_len: bool  # sglang:context_len
    repetition_penalty_zero_allowed: bool  # [0, 2] until 0.5.11, (0, 2] from 0.5.12.post1
    nan_check_inclusive: bool  # "NaN happened" for ids >= vocab (0.5.14+) or only > vocab (off by one, earlier)
    kimi_k2_reasoning_ends_at_tool_section: bool  # the kimi_k2 reasoning parser ends at <|tool_calls_section_begin|>
    # sampling_params keys /generate accepts: SamplingParams' own (its constructor, or from 0.5.15.post1 a
    # msgspec.Struct that also takes its internal fields), from 0.5.22 the JSON contract gate's list.
    sampling_keys: tuple[str, ...]
    # Tokenizer-side counters and latency histograms carry is_streaming="true"/"false" from 0.5.17.
    metric_is_streaming_label: bool
    # From 0.5.21 the scheduler also cuts max_new_tokens to what an empty KV pool holds (whole pages).
    kv_memory_cap: bool
    # /server_info keys beyond ServerArgs, the scheduler's info, internal_states and version.
    server_info_extra_keys: tuple[str, ...]
    transformers_pin: str
    default_cuda: str  # CUDA of the plain vX image tag
    # --attention-backend choices of the argument parser (0.5.9 server_args.py:122; 0.5.23 arg_groups/choices.py:69).
    attention_backends: tuple[str, ...]
    # Backends --enable-deterministic-inference accepts (any other raises ValueError at start), and those of them
    # that keep the radix cache (0.5.9 server_args.py:154,156; 0.5.23 arg_groups/choices.py:113,249).
    deterministic_attention_backends: tuple[str, ...]
    radix_deterministic_attention_backends: tuple[str, ...]
    # Architectures the deterministic check holds to the radix-supported backends ("absorbed-MLA models"; 0.5.9
    # server_args.py:2729-2736; 0.5.23 arg_groups/attention_hook.py:623-632). Kimi-K2.5, MLA too, is not listed.
    deterministic_mla_architectures: tuple[str, ...]
    # --enable-return-aux-hidden-states: the target's EAGLE-3 aux hidden states without a draft, from 0.5.23
    # (0.5.23 arg_groups/fields/exec_.py:130-157, arg_groups/validation_hook.py:697-752); earlier releases return
    # only the last layer (--enable-return-hidden-states, 0.5.9 server_args.py:628). facts/hidden_states.py.
    aux_hidden_states: bool

    @property
    def image(self) -> str:
        return f"{IMAGE_REPOSITORY}:v{self.version}"

    def serves(self, architecture: str) -> bool:
        """Whether this release registers the architecture natively (else SGLang falls back to the Transformers
        backend, which cannot serve large MoE checkpoints such as Kimi-K2.5)."""
        first = _architectures().get(architecture)
        return first is not None and _at_least(self.version, first)

    def image_cuda(self, image: str) -> str | None:
        """The CUDA an image of this release was built with: its -cuXYZ suffix (v0.5.19-cu129 → 12.9), else the plain
        tag's; None for a ROCm image."""
        tag = image.rsplit(":", 1)[-1] if ":" in image.split("/")[-1] else ""
        if "rocm" in tag:
            return None
        suffix = _CUDA_SUFFIX.search(tag)
        return f"{int(suffix.group(1))}.{suffix.group(2)}" if suffix else self.default_cuda

    def cuda12_image(self) -> str | None:
        if not _at_least(LAST_CUDA12_RELEASE, self.version):
            return None
        return f"{self.image}-cu129"

    def rocm_image(self, gpu_family: Literal["mi30x", "mi35x"]) -> str:
        """SGLang's ROCm image for MI300X/MI325X (mi30x, gfx942) or MI350X/MI355X (mi35x, gfx950)."""
        return f"{self.image}-rocm700-{gpu_family}"

    def refuses_total(self, prompt_tokens: int, max_new_tokens: int, context_length: int) -> bool:
        """Would this release answer 400 for prompt + max_new_tokens against the context length?"""
        total = prompt_tokens + max_new_tokens
        return total >= context_length if self.context_rule == ">=" else total > context_length


@cache
def _architectures() -> dict[str, str]:
    """Architecture -> the first read release that registers it ("0.5.6" means 0.5.6 or earlier)."""
    text = resources.files(__package__).joinpath("data/sglang_architectures.json").read_text()
    registered: dict[str, str] = json.loads(text)
    return registered


def _build(version: str, released: str) -> Release:
    def since(first: str) -> bool:
        return _at_least(version, first)

    kv = ["auto", "fp8_e5m2", "fp8_e4m3", "bf16", "bfloat16"]
    if since("0.5.16"):
        kv[3:3] = ["mxfp8"]
        kv += ["nvfp4", "fp4_mx_block16"]
    if not since("0.5.21"):
        kv.append("fp4_e2m1")
    return Release(
        version=version, released=released, supported=since(OLDEST_SUPPORTED),
        kv_cache_dtypes=tuple(kv),
        context_rule=">" if since("0.5.11") else ">=",
        retractions_key="num_retractions" if since("0.5.12.post1") else "total_retractions",
        has_reasoning_tokens=since("0.5.10.post1"),
        has_cached_tokens_details=since("0.5.9"),
        echoes_prompt_ids=since("0.5.13.post1"),
        routes_dp_rank=since("0.5.10.post1"),
        eos_at_cap="stop" if since("0.5.18") else "length",
        unknown_sampling_key_status=400 if since("0.5.22") else 500,
        abort_statuses_as_http="400-599" if since("0.5.23") else "400/500/503",
        dp_attention_flag="--attn-dp-size" if since("0.5.22") else "--enable-dp-attention",
        effective_max_running_per_dp=since("0.5.8"),
        server_info_resolved=since("0.5.19"),
        metric_engine_type_label=since("0.5.11"),
        metric_context_len=since("0.5.11"),
        repetition_penalty_zero_allowed=not since("0.5.12.post1"),
        nan_check_inclusive=since("0.5.14"),
        kimi_k2_reasoning_ends_at_tool_section=since("0.5.10.post1"),
        sampling_keys=_sampling_keys(version),
        metric_is_streaming_label=since("0.5.17"),
        kv_memory_cap=since("0.5.21"),
        server_info_extra_keys=tuple(key for first, key in _SERVER_INFO_KEYS if since(first)),
        transformers_pin=_transformers_pin(version),
        default_cuda="13.0" if since("0.5.11") else "12.9",
        attention_backends=_changed(version, _ATTENTION_BACKENDS),
        deterministic_attention_backends=_changed(version, _DETERMINISTIC_BACKENDS),
        radix_deterministic_attention_backends=_changed(version, _RADIX_DETERMINISTIC_BACKENDS),
        deterministic_mla_architectures=_changed(version, _DETERMINISTIC_MLA_ARCHITECTURES),
        aux_hidden_states=since("0.5.23"),
    )


# A list as change points: (first release, added, removed), read in order from the oldest supported release.
ListChanges = tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...]


def _changed(version: str, changes: ListChanges) -> tuple[str, ...]:
    items: list[str] = []
    for index, (first, added, removed) in enumerate(changes):
        if index == 0 or _at_least(version, first):  # the first row is the base, also for older releases
            items = [item for item in items if item not in removed] + list(added)
    return tuple(items)


# ATTENTION_BACKEND_CHOICES (0.5.9 server_args.py:122; 0.5.23 arg_groups/choices.py:69).
_ATTENTION_BACKENDS: ListChanges = (
    ("0.5.9", ("triton", "torch_native", "flex_attention", "nsa", "cutlass_mla", "fa3", "fa4", "flashinfer",
               "flashmla", "trtllm_mla", "trtllm_mha", "dual_chunk_flash_attn", "aiter", "wave", "intel_amx",
               "ascend", "intel_xpu"), ()),
    ("0.5.12.post1", ("compressed", "dsv4", "tokenspeed_mla"), ()),
    ("0.5.13.post1", ("cutedsl_mla", "dsa"), ()),
    ("0.5.17", ("hpc_ops",), ()),
    ("0.5.19", ("minicpm_flashattn", "minicpm_flashinfer"), ()),
    ("0.5.20", ("qsa",), ("cutlass_mla", "dual_chunk_flash_attn")),
    ("0.5.22", ("llada2_cfg_flashinfer",), ()),
)
# DETERMINISTIC_ATTENTION_BACKEND_CHOICES (0.5.9 server_args.py:154; 0.5.13.post1 :199; 0.5.16 :223; 0.5.19 :234;
# 0.5.23 arg_groups/choices.py:113).
_DETERMINISTIC_BACKENDS: ListChanges = (
    ("0.5.9", ("flashinfer", "fa3", "triton"), ()),
    ("0.5.13.post1", ("ascend",), ()),
    ("0.5.16", ("fa4",), ()),
    ("0.5.19", ("intel_xpu",), ()),
)
# RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND (0.5.9 server_args.py:156; 0.5.16 :231; 0.5.23
# arg_groups/choices.py:249).
_RADIX_DETERMINISTIC_BACKENDS: ListChanges = (
    ("0.5.9", ("fa3", "triton"), ()),
    ("0.5.13.post1", ("ascend",), ()),
    ("0.5.16", ("fa4",), ()),
)
# The is_deepseek_model list of the deterministic check (0.5.9 server_args.py:2729; 0.5.18 arg_groups/overrides.py;
# 0.5.20 arg_groups/attention_hook.py; 0.5.23 arg_groups/attention_hook.py:623).
_DETERMINISTIC_MLA_ARCHITECTURES: ListChanges = (
    ("0.5.9", ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "MistralLarge3ForCausalLM",
               "PixtralForConditionalGeneration", "GlmMoeDsaForCausalLM"), ()),
    ("0.5.18", ("Glm4MoeLiteForCausalLM",), ()),
    ("0.5.20", ("Glm5NextForConditionalGeneration",), ()),
)


# SamplingParams.__init__ (0.5.9 sampling/sampling_params.py:40; 0.5.14 sampling/sampling_params.py:71).
_SAMPLING_KEYS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "custom_params", "stream_interval", "logit_bias", "sampling_seed",
)
# The msgspec.Struct's internal fields, accepted as keywords too (0.5.15.post1 sampling/sampling_params.py:75,116).
_SAMPLING_INTERNAL = ("stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len", "is_normalized")
# The 0.5.22 JSON contract gate's SamplingParams, in its order (0.5.22 sglang/api/v1/api_types.py:177-206); 0.5.23
# adds `choice` (0.5.23 sglang/api/v1/api_types.py:207).
_CONTRACT_SAMPLING_KEYS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark",
)


def _sampling_keys(version: str) -> tuple[str, ...]:
    if _at_least(version, "0.5.23"):
        return (*_CONTRACT_SAMPLING_KEYS, "choice")
    if _at_least(version, "0.5.22"):
        return _CONTRACT_SAMPLING_KEYS
    keys: tuple[str, ...] = _SAMPLING_KEYS
    if _at_least(version, "0.5.15.post1"):
        keys += _SAMPLING_INTERNAL
    if _at_least(version, "0.5.19"):
        keys += ("beam_width",)  # 0.5.19 sampling/sampling_params.py:76
    if _at_least(version, "0.5.20"):
        keys += ("ebnf_full_assistant",)  # 0.5.20 sampling/sampling_params.py:162
    return keys


# (first release, key): startup_time and kv_events (0.5.17), launch_command (0.5.19, with the resolved values),
# frontend (0.5.21).
_SERVER_INFO_KEYS = (("0.5.17", "startup_time"), ("0.5.17", "kv_events"), ("0.5.19", "launch_command"),
                     ("0.5.21", "frontend"))


@dataclass(frozen=True)
class SGLangMetric:
    name: str  # sglang:...
    kind: Literal["gauge", "counter", "histogram", "summary", "gaugehistogram"]
    first: str  # the first release read that defines it ("0.5.6": 0.5.6 or earlier)
    last: str | None  # the last release that defines it, None when the latest still does


@cache
def sglang_metrics() -> dict[str, SGLangMetric]:
    """Every Prometheus metric the releases read define (an AST scan of their metric collectors, 0.5.9
    metrics/collector.py, 0.5.23 observability/metrics_collector.py)."""
    text = resources.files(__package__).joinpath("data/sglang_metrics.json").read_text()
    return {name: SGLangMetric(name, item["type"], item["first"], item.get("last"))
            for name, item in json.loads(text).items()}


def metric_in(name: str, version: str) -> bool:
    """Whether SGLang `version` exports the metric `name` (sglang:...)."""
    metric = sglang_metrics().get(name)
    if metric is None:
        return False
    return _at_least(version, metric.first) and (metric.last is None or _at_least(metric.last, version))


def metrics_in_every_supported_release() -> dict[str, SGLangMetric]:
    return {name: metric for name, metric in sglang_metrics().items()
            if all(metric_in(name, version) for version in SUPPORTED_RELEASES)}


def _transformers_pin(version: str) -> str:
    pins = (("0.5.22", "5.19.0"), ("0.5.15.post1", "5.12.1"), ("0.5.13.post1", "5.8.1"), ("0.5.11", "5.6.0"),
            ("0.5.10.post1", "5.3.0"))
    return next((pin for first, pin in pins if _at_least(version, first)), "4.57.1")


RELEASES: dict[str, Release] = {version: _build(version, date) for version, date in _RELEASES}
SUPPORTED_RELEASES: tuple[str, ...] = tuple(v for v, r in RELEASES.items() if r.supported)


def release(version: str) -> Release:
    """The facts of a release; a patch not read (e.g. 0.5.12 when 0.5.12.post1 was read) resolves to the read
    release of the same minor line it most resembles, the latest one not newer than it, else the line's only one."""
    key = version_key(version)
    exact = next((r for v, r in RELEASES.items() if version_key(v) == key), None)
    if exact is not None:
        return exact
    same_line = [v for v in RELEASES if version_key(v)[:3] == key[:3]]
    if same_line:
        return RELEASES[same_line[0]]
    known = ", ".join(RELEASES)
    raise UnknownReleaseError(f"SGLang {version} is not a release tokenmill knows; known: {known}")


def release_of_image(image: str) -> str | None:
    """The SGLang version an image tag names (lmsysorg/sglang:v0.5.23, …:v0.5.19-cu129, …:v0.5.9-rocm700-mi30x),
    or None for a tag that names none (latest, a digest, a custom build)."""
    match = _IMAGE_TAG.search(image.split("@", 1)[0])
    return match.group(1) if match else None


def is_moving_tag(image: str) -> bool:
    """Whether the image's tag is one SGLang moves (latest, latest-runtime, nightly-…, dev-…)."""
    return _MOVING_TAG.search(image.split("@", 1)[0]) is not None
