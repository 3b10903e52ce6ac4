"""What a server plan is: the settings SGLang runs with and the numbers behind them (status.serverPlan and
`tokenmill plan --json`), and the error raised when no plan fits."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class ServerPlan(BaseModel):
    """The server configuration actually used, with the numbers behind it (camelCase in status and JSON)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    tensor_parallel: int = Field(description="--tp-size: GPUs per replica (spans nodes when > GPUs per node).")
    nodes_per_replica: int = Field(description="Nodes one replica spans (--nnodes).")
    gpus_per_node: int = Field(description="GPUs requested per server pod.")
    replicas: int = Field(description="Independent server replicas.")
    mem_fraction_static: str = Field(description="--mem-fraction-static, as a decimal string.")
    context_length: int = Field(description="--context-length.")
    max_running_requests: int = Field(description="--max-running-requests.")
    kv_cache_dtype: str = Field(description="--kv-cache-dtype.")
    gpu_product: str | None = Field(None, description="GPU product the plan is for.")
    gpu_memory_mib: int = Field(description="Memory of one GPU, MiB.")
    weight_bytes: int = Field(description="Total weight size, bytes.")
    weight_bytes_per_gpu: int = Field(description="Weights held by one GPU at this tensor-parallel size, bytes.")
    kv_bytes_per_token: int = Field(description="KV-cache bytes per token for the whole replica (MLA-aware).")
    kv_capacity_tokens: int = Field(description="KV-cache capacity of one replica, tokens.")
    expected_tokens_per_request: int = Field(description="Prompt + output tokens a request is expected to hold.")
    concurrent_requests_at_expected_length: int = Field(
        description="Requests that fit the KV cache at the expected length."
    )
    overrides: list[str] = Field(default_factory=list, description="Fields taken from the spec as given.")
    reasoning: list[str] = Field(default_factory=list, description="The arithmetic, one line per step.")


class PlanError(ValueError):
    """No server plan fits; the message names the spec field to change and the numbers behind it."""
