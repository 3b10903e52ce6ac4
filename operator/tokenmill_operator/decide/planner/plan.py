"""What a server plan is: the settings SGLang runs with and the numbers behind them (status.serverPlan and
`tokenmill plan --json`), the predicted throughput and ETA of the chosen layout and of its alternatives, and the
error raised when no plan fits."""

from __future__ import annotations

from pydantic import Field

from tokenmill_runner.spec.resource import SpecModel

from .startup import StartupPlan


class DatasetEta(SpecModel):
    """One dataset's share of the prediction: its lengths and when its last sample is done."""

    name: str = Field(description="The dataset.")
    samples: int = Field(description="Samples (limit x samples per prompt, or the assumed count).")
    prompt_tokens: int = Field(description="Mean prompt tokens.")
    prompt_source: str = Field(description="sampled (rows tokenized at plan time) or assumed (the flat estimate).")
    mean_output_tokens: int = Field(description="Mean output tokens the ETA assumes.")
    output_source: str = Field(description="earlier answers (the sampled rows'), fixed, or seeds' shape.")
    done_seconds: int = Field(description="Seconds from the first request until its last sample is done.")


class PredictionRange(SpecModel):
    """The interval around a prediction: the spread of the model's errors on published records of the same
    hardware class, each predicted without its own source (facts/intervals.py)."""

    output_tokens_per_second_low: int = Field(description="Low end of the job's output tokens/s.")
    output_tokens_per_second_high: int = Field(description="High end of the job's output tokens/s.")
    eta_seconds_low: int = Field(description="ETA at the high end of the rate.")
    eta_seconds_high: int = Field(description="ETA at the low end of the rate.")
    basis: str = Field(description="Which records the interval comes from, and why it is widened.")


class Prediction(SpecModel):
    """What the throughput model predicts for one layout on this job (docs/throughput.md)."""

    decode_tokens_per_second: int = Field(
        description="Steady decode output tokens/s of all replicas at the full batch, no prefill.")
    output_tokens_per_second: int = Field(
        description="The job's average output tokens/s: prefill and the draining tail included.")
    eta_seconds: int = Field(description="Predicted seconds from the start (weights copied and loaded, see "
                                         "startup) to the last committed sample.")
    gpu_hours: float = Field(description="GPUs x the time they are held (start-up, generation and the hidden-state "
                             "capture pass), hours.")
    generation_seconds: int | None = Field(
        None, description="Of the ETA: from the first request to the last committed sample.")
    capture_seconds: int | None = Field(
        None, description="Of the ETA: the hidden-state capture pass after generation (spec.hiddenStates), the "
        "longer of its prefill forwards and its states' JSON through the runner (docs/planning.md); None without it.")
    relaunch_seconds: int | None = Field(
        None, description="Of the ETA: the server's restarts between hidden-state passes (layouts [specforge]: "
        "relaunched for the final state), each a start-up without the copy when the weights are cached; None "
        "without them.")
    capture_bound: str | None = Field(
        None, description="What bounds the capture pass: prefill (the server's forwards) or json (the states' text "
        "through the runner).")
    batch_per_replica: int = Field(description="Requests one replica runs at once (KV cache, slots or concurrency).")
    held_kv_tokens: int | None = Field(
        None, description="KV tokens a running request holds on average over the job (prompt + E[o^2] / 2E[o]): "
        "the context the decode step is predicted at.")
    step_seconds_per_kv_token: float | None = Field(
        None, description="How much a replica's decode step at its batch grows per KV token a request holds more "
        "(its KV reads): the verification compares the step at the context SGLang reports, not at the job's "
        "average, which the first minutes' young requests are below.")
    bound: str = Field(description="What limits a full decode step: memory, compute or overhead (floor, links).")
    samples: int = Field(description="Samples the ETA is for.")
    samples_assumed: bool = Field(False, description="True when a dataset without limit was counted as 10,000.")
    interval: PredictionRange | None = Field(None, description="The range the prediction is expected in.")
    datasets: list[DatasetEta] = Field(default_factory=list, description="Per dataset: lengths and finish time.")


class Candidate(SpecModel):
    """One server layout the planner considered, with its prediction or why it cannot run."""

    replicas: int = Field(description="Server replicas.")
    tensor_parallel: int = Field(description="GPUs per replica.")
    attention_data_parallel: int = Field(1, description="DP attention groups per replica (1 = off).")
    kv_cache_dtype: str = Field("auto", description="--kv-cache-dtype.")
    gpus: int = Field(description="GPUs in all.")
    kv_capacity_tokens: int = Field(0, description="KV tokens one replica holds.")
    prediction: Prediction | None = Field(None, description="None when the layout cannot run.")
    chosen: bool = Field(False, description="The layout the plan uses.")
    choosable: bool = Field(False, description="The plan could use it as the spec stands (it runs, it needs no "
                            "other kvCacheDtype, the spec's fixed fields allow it): a re-plan suggests only these.")
    note: str = Field("", description="Why it cannot run, why it is not chosen, or what it needs.")


class MemoryTerm(SpecModel):
    """One use of a GPU's memory outside --mem-fraction-static, as the plan counts it."""

    name: str = Field(description="What the memory is for.")
    mib: int = Field(description="MiB per GPU.")
    source: str = Field(description="How it is computed, with the SGLang source it mirrors.")


class ServerPlan(SpecModel):
    """The server configuration actually used, with the numbers behind it (camelCase in status and JSON)."""

    tensor_parallel: int = Field(description="--tp-size: GPUs per replica (spans nodes when > GPUs per node).")
    nodes_per_replica: int = Field(description="Nodes one replica spans (--nnodes).")
    gpus_per_node: int = Field(description="GPUs requested per server pod.")
    replicas: int = Field(description="Independent server replicas.")
    attention_data_parallel: int = Field(1, description="DP attention groups per replica (1 = off).")
    mem_fraction_static: str = Field(description="--mem-fraction-static, as a decimal string.")
    context_length: int = Field(description="--context-length.")
    max_running_requests: int = Field(description="--max-running-requests.")
    cuda_graph_max_bs: int | None = Field(
        None, description="Decode CUDA-graph batch per DP attention group, when the plan sets it.")
    chunked_prefill_size: int | None = Field(
        None, description="--chunked-prefill-size when the plan sets it; None: SGLang's default for the GPU. Under DP "
        "attention SGLang divides it by the groups: each group prefills this / attentionDataParallel per forward.")
    load_balance_method: str | None = Field(
        None, description="--load-balance-method under DP attention (total_tokens); None: SGLang's round robin.")
    memory_split: list[MemoryTerm] = Field(
        default_factory=list, description="Per GPU, what sits outside --mem-fraction-static, term by term; empty "
        "when SGLang's own default rule sets the fraction.")
    kv_cache_dtype: str = Field(description="--kv-cache-dtype.")
    attention_backend: str | None = Field(
        None, description="--attention-backend the server runs with: tokenmill passes one with deterministicInference, "
        "or extraArgs sets it; None: SGLang picks by GPU and model.")
    sglang_version: str | None = Field(None, description="SGLang release the plan is for.")
    image: str | None = Field(None, description="SGLang image the server runs: spec.server.image, or its CUDA 12 "
                              "(-cu129) tag when the nodes' driver cannot run the image's CUDA.")
    cuda_driver_major: int | None = Field(
        None, description="NVIDIA driver branch of the GPU nodes the image was checked against, when known.")
    gpu_product: str | None = Field(None, description="GPU product the plan is for.")
    gpu_vendor: str = Field("nvidia", description="nvidia or amd: the device plugin resource and node label used.")
    gpu_memory_mib: int = Field(description="Memory of one GPU, MiB.")
    interconnect: str = Field("", description="The link tensor parallelism runs over: nvlink, xgmi, pcie, network.")
    weight_bytes: int = Field(description="Total weight size, bytes.")
    weight_bytes_per_gpu: int = Field(description="Weights held by one GPU in this layout, bytes.")
    kv_bytes_per_token: int = Field(description="KV-cache bytes per token for the whole replica (MLA-aware).")
    kv_capacity_tokens: int = Field(description="KV-cache capacity of one replica, tokens.")
    expected_tokens_per_request: int = Field(description="Prompt + output tokens a running request holds on average.")
    concurrent_requests_at_expected_length: int = Field(
        description="Requests that fit one replica's KV cache at the expected length."
    )
    prediction: Prediction | None = Field(None, description="Predicted throughput, ETA and GPU-hours of this layout.")
    startup: StartupPlan | None = Field(None, description="Predicted copy and load of the weights (in the ETA).")
    candidates: list[Candidate] = Field(default_factory=list, description="Every layout considered, chosen one marked.")
    measured_constants: str | None = Field(
        None, description="The cluster's measured step constants the plan starts from: their key in the operator's "
        "ConfigMap tokenmill-measured-constants (GPU product, interconnect, SGLang release, model architecture); "
        "None: the published fit.")
    overrides: list[str] = Field(default_factory=list, description="Fields taken from the spec as given.")
    reasoning: list[str] = Field(default_factory=list, description="The arithmetic, one line per step.")


class PlanError(ValueError):
    """No server plan fits; the message names the spec field to change and the numbers behind it."""
