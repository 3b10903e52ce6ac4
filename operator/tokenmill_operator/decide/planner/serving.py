"""Which SGLang release and which GPU a spec runs on, and what that release would refuse. Pure.

The release comes from spec.server.sglangVersion, else the image tag (lmsysorg/sglang:v0.5.9-cu129 → 0.5.9),
else the default release with a warning that the checks assume it. Refused at plan time, each with the field and
the reason, because the server would otherwise fail after the GPUs are allocated (or loop in CrashLoopBackOff):
an architecture the release does not register, a KV cache dtype its parser rejects, a context length above what
it derives from config.json, a CUDA image on AMD GPUs or a ROCm image on NVIDIA ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill_runner.facts.hardware import Gpu, find, products
from tokenmill_runner.facts.hidden_states import check_layer_ids, check_layouts
from tokenmill_runner.facts.model_facts import ModelFacts
from tokenmill_runner.facts.releases import (
    DEFAULT_RELEASE,
    IMAGE_REPOSITORY,
    LAST_CUDA12_RELEASE,
    MIN_DRIVER_BY_CUDA_MAJOR,
    OLDEST_SUPPORTED,
    SUPPORTED_RELEASES,
    Release,
    UnknownReleaseError,
    release,
    release_of_image,
)
from tokenmill_runner.spec.resource import HiddenStatesSpec, ServerSpec

from .plan import PlanError

MEMORY_FIELD = "spec.server." + (ServerSpec.model_fields["gpu_memory_mib"].alias or "gpu_memory_mib")
DRIVER_FIELD = "spec.server." + (ServerSpec.model_fields["cuda_driver_major"].alias or "cuda_driver_major")
# GPU feature discovery's label for the NVIDIA driver branch of a node (e.g. 570, 580).
DRIVER_LABEL = "nvidia.com/cuda.driver.major"


@dataclass(frozen=True)
class ServingRelease:
    release: Release
    source: str  # where the version came from, for the plan's reasoning
    warnings: tuple[str, ...] = ()


def serving_release(server: ServerSpec) -> ServingRelease:
    """The release the spec's image runs, and where that was read."""
    version: str | None = server.sglang_version
    source = "spec.server.sglangVersion"
    if not version:
        version, source = release_of_image(server.image), f"the image tag ({server.image})"
    if version is None:
        return ServingRelease(
            release(DEFAULT_RELEASE), f"SGLang {DEFAULT_RELEASE}, the default release",
            (f"warning: the image {server.image} names no SGLang release; the checks and the plan assume "
             f"{DEFAULT_RELEASE} (set spec.server.sglangVersion to the release the image was built from)",))
    try:
        facts = release(version)
    except UnknownReleaseError:
        raise PlanError(f"{source} names SGLang {version}, which tokenmill has no facts for: use an image of a "
                        f"supported release ({OLDEST_SUPPORTED} to {SUPPORTED_RELEASES[-1]}) or set "
                        f"spec.server.sglangVersion") from None
    warnings: tuple[str, ...] = ()
    if not facts.supported:
        warnings = (f"warning: SGLang {facts.version} is older than tokenmill supports ({OLDEST_SUPPORTED} to "
                    f"{SUPPORTED_RELEASES[-1]}); the plan uses its known facts",)
    return ServingRelease(facts, f"SGLang {facts.version} from {source}", warnings)


@dataclass(frozen=True)
class ServerImage:
    """The SGLang image the server runs, and why (for the plan's reasoning)."""

    image: str
    reason: str
    driver_major: int | None = None


def _cuda12_fallback(server: ServerSpec, facts: Release) -> str | None:
    """A CUDA 12 image of the same release (plain vX tag → vX-cu129), or, for the default image left unset, of the
    last release that has one."""
    plain = server.image == facts.image
    if plain and facts.cuda12_image():
        return facts.cuda12_image()
    if "image" not in server.model_fields_set and not server.sglang_version:
        return release(LAST_CUDA12_RELEASE).cuda12_image()
    return None


def server_image(server: ServerSpec, gpu: Gpu | None, node_driver_major: int | None = None) -> ServerImage:
    """spec.server.image, unless the GPU nodes' NVIDIA driver cannot run the CUDA it was built with: then a -cu129
    image that it can (SGLang's own CUDA 12 tags), or a refusal with the reason, before any GPU is allocated (the
    server would otherwise fail at its first CUDA call and restart forever). The driver is spec.server.cudaDriverMajor,
    else what the operator read from the nodes' nvidia.com/cuda.driver.major label."""
    version = server.release_version()
    if version is None or (gpu is not None and gpu.vendor == "amd"):
        return ServerImage(server.image, "")
    try:
        facts = release(version)
    except UnknownReleaseError:
        return ServerImage(server.image, "")  # serving_release refuses it, naming the field
    cuda = facts.image_cuda(server.image)
    if cuda is None:
        return ServerImage(server.image, "")
    need = MIN_DRIVER_BY_CUDA_MAJOR[int(cuda.split(".")[0])]
    driver = server.cuda_driver_major or node_driver_major
    source = DRIVER_FIELD if server.cuda_driver_major else f"the GPU nodes' label {DRIVER_LABEL}"
    if driver is None:
        return ServerImage(server.image, f"{server.image} runs CUDA {cuda}, which needs NVIDIA driver {need} or newer; "
                                         f"the nodes' driver is unknown (set {DRIVER_FIELD}, or label the nodes with "
                                         f"NVIDIA GPU feature discovery: {DRIVER_LABEL})")
    if driver >= need:
        return ServerImage(server.image, f"{server.image} runs CUDA {cuda}; driver {driver} ({source}) runs it "
                                         f"(needs {need} or newer)", driver)
    fallback = _cuda12_fallback(server, facts)
    if fallback and driver >= MIN_DRIVER_BY_CUDA_MAJOR[12]:
        return ServerImage(fallback, f"{server.image} runs CUDA {cuda}, which needs NVIDIA driver {need} or newer, and "
                                     f"the nodes run {driver} ({source}): the server runs {fallback} (CUDA 12.9) "
                                     f"instead", driver)
    older = (f"use an image the driver runs ({IMAGE_REPOSITORY}:v{LAST_CUDA12_RELEASE}-cu129 is the last CUDA 12 "
             f"image) or " if driver >= MIN_DRIVER_BY_CUDA_MAJOR[12] else "")
    raise PlanError(f"spec.server.image {server.image} runs CUDA {cuda}, which needs NVIDIA driver {need} or newer, "
                    f"and the GPU nodes run driver {driver} ({source}): the server would fail at its first CUDA call; "
                    f"{older}upgrade the nodes' driver")


def gpu_product(server: ServerSpec) -> Gpu | None:
    """The spec's GPU product, None when it names none or one tokenmill does not know."""
    return find(server.gpu_product) if server.gpu_product else None


def gpu_memory_mib(server: ServerSpec, gpu: Gpu | None) -> int:
    """Memory of one GPU in MiB: the spec's own number when set, else the known size of the product."""
    if server.gpu_memory_mib is not None:
        return server.gpu_memory_mib
    if gpu is not None:
        return gpu.memory_mib
    if not server.gpu_product:
        raise PlanError(f"GPU memory unknown: set spec.server.gpuProduct (e.g. NVIDIA-H200) or {MEMORY_FIELD}")
    known = ", ".join(sorted(products()))
    raise PlanError(f"unknown GPU product {server.gpu_product!r}: set {MEMORY_FIELD} to the memory of one GPU in MiB "
                    f"(nvidia-smi --query-gpu=memory.total, or the node label nvidia.com/gpu.memory); known "
                    f"products: {known}")


def check_image(server: ServerSpec, gpu: Gpu | None, serving: ServingRelease) -> None:
    """AMD GPUs need SGLang's ROCm image of the right family; NVIDIA GPUs a CUDA one."""
    if gpu is None:
        return
    tag = server.image.rsplit(":", 1)[-1].lower() if ":" in server.image else ""
    rocm = "rocm" in tag
    facts = serving.release
    if gpu.vendor == "amd":
        family = gpu.rocm_family or "mi30x"
        if not rocm:
            raise PlanError(f"spec.server.image {server.image} is a CUDA image, and {gpu.label} is an AMD GPU: use "
                            f"SGLang's ROCm image {facts.rocm_image(family)}")  # type: ignore[arg-type]
        if family not in tag:
            raise PlanError(f"spec.server.image {server.image} is not built for {gpu.label} ({gpu.arch}): use "
                            f"{facts.rocm_image(family)}")  # type: ignore[arg-type]
    elif rocm:
        raise PlanError(f"spec.server.image {server.image} is a ROCm image, and {gpu.label} is an NVIDIA GPU: use "
                        f"{facts.image}")


def check_architecture(model: ModelFacts, serving: ServingRelease) -> None:
    """A release that does not register the architecture falls back to the Transformers backend, which cannot serve
    a large MoE model (docs/sglang-release-facts.md §B): refuse it, naming the first release that serves it."""
    facts = serving.release
    if model.architecture is None or facts.serves(model.architecture):
        return
    first = next((v for v in SUPPORTED_RELEASES if release(v).serves(model.architecture)), None)
    fix = (f"use SGLang {first} or later (e.g. lmsysorg/sglang:v{DEFAULT_RELEASE})" if first else
           "no release tokenmill knows registers it")
    raise PlanError(f"spec.server.image: {serving.source} does not register {model.architecture} (config.json "
                    f"architectures); it would fall back to the Transformers backend, which cannot serve this model: "
                    f"{fix}")


def check_hidden_states(states: HiddenStatesSpec | None, model: ModelFacts) -> None:
    """spec.hiddenStates against config.json (the spec alone knows neither the architecture nor L): the layer ids
    SGLang accepts for this model, and the trainer layouts it can serve (facts/hidden_states.check_layouts)."""
    if states is None:
        return
    try:
        if states.layer_ids is not None:
            check_layer_ids(states.layer_ids, model.num_layers)
        check_layouts(states.layouts, states.layer_ids, model.architecture, model.num_layers)
    except ValueError as error:
        raise PlanError(f"spec.hiddenStates.{error}") from None


def check_kv_cache_dtype(server: ServerSpec, serving: ServingRelease) -> None:
    facts = serving.release
    if server.kv_cache_dtype != "auto" and server.kv_cache_dtype not in facts.kv_cache_dtypes:
        raise PlanError(f"spec.server.kvCacheDtype {server.kv_cache_dtype!r}: {serving.source} does not accept it "
                        f"(its argument parser exits and the pod restarts forever); it accepts "
                        f"{', '.join(facts.kv_cache_dtypes)}")


def context_length(server: ServerSpec, model: ModelFacts, needed: int | None = None) -> tuple[int, str]:
    """--context-length and why: for auto, what the job needs (`needed`: the longest sampled prompt with headroom
    plus maxNewTokens, workload.py) when that is known and below SGLang's own derivation from config.json, else that
    derivation. A shorter context shrinks the req_to_token pool SGLang allocates per request slot
    (mem_cache/memory_pool.py:406): 2 GiB per GPU at 262,144 and 2,048 slots. A larger given value is refused because
    SGLang refuses to start with it (0.5.23 configs/model_config.py:1315) unless
    SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1."""
    derived = model.sglang_context_length or 2048
    key = model.context_key or "no context key (SGLang's fallback 2048)"
    rope = f" x rope factor {model.rope_factor:g}" if model.rope_factor != 1 else ""
    if server.context_length == "auto":
        if needed is not None and needed < derived:
            return needed, (f"the job's need: 2 x the longest sampled prompt + maxNewTokens, rounded up to 1,024 "
                            f"(the model allows {derived:,}: {key}{rope})")
        return derived, f"{key}{rope}"
    if server.context_length > derived:
        raise PlanError(f"spec.server.contextLength {server.context_length:,} is above the {derived:,} SGLang derives "
                        f"from config.json ({key}{rope}); SGLang refuses to start with a longer context unless "
                        f"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 (then outputs past {derived:,} are not "
                        f"trustworthy): lower it or leave it auto")
    return server.context_length, "spec.server.contextLength"
