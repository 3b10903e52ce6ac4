"""The simulator's settings, and the `tokenmill sim-server` flags that fill them (one flag per field)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from tokenmill_runner.facts.releases import DEFAULT_RELEASE, SUPPORTED_RELEASES, UnknownReleaseError, release

from .profiles import AUTO, PROFILES

DEFAULT_HOST = "127.0.0.1"  # like SGLang: pods must pass --host 0.0.0.0
DEFAULT_PORT = 30000


@dataclass(frozen=True)
class SimConfig:
    model_path: str  # folder with config.json and tokenizer files (e.g. examples/demo-model)
    sglang_version: str = DEFAULT_RELEASE  # whose behaviour it shows (wire format, limits, metrics)
    seed: int = 0
    max_running_requests: int = 256
    # KV pool in tokens. Admission goes by SGLang's estimate and retracts when decode runs out (capacity.py). The
    # default holds 256 requests of 10k+ tokens, so by default slots, not KV, bound the batch (as in DESIGN.md).
    max_total_tokens: int = 4_000_000
    page_size: int = 1  # KV page size (--page-size); from 0.5.21 it rounds the per-request memory cap
    context_length: int | None = None  # None: config.json max_position_embeddings
    step_ms: float = 20.0  # simulated decode step time at an empty batch
    step_ms_per_request: float = 0.05  # added per running request
    prefill_ms_per_1k_tokens: float = 30.0  # added to the step that admits a prompt
    time_scale: float = 1.0  # simulated seconds per real second (100 => 100x faster)
    profile: str = AUTO  # auto | glaive | reasoning | swe
    startup_seconds: float = 0.0  # real seconds of "weight loading": /health answers 503 until then
    fault_503_rate: float = 0.0  # share of /generate requests answered 503 (like a full queue)
    # From this many real seconds after start, for fault_503_for_s seconds, every /generate answers 503 (a queue
    # that stays full); /health keeps answering 200, as SGLang's does while its scheduler produces output.
    fault_503_after_s: float | None = None
    fault_503_for_s: float = 0.0
    fault_nan_rate: float = 0.0  # share of requests whose output hits NaN logits ("NaN happened")
    fault_reset_rate: float = 0.0  # share whose connection is dropped instead of answered
    fault_abort_rate: float = 0.0  # share of items finishing with finish_reason {type: abort}
    fault_slow_rate: float = 0.0  # share answered only after fault_slow_seconds extra (real) seconds
    # share of answers whose echoed prompt_token_ids differ from the ids sent (as behind a proxy that re-encodes)
    fault_input_mismatch_rate: float = 0.0
    fault_slow_seconds: float = 5.0
    # A poison prompt: the process dies when a prompt contains this text, as SGLang's does when its scheduler hits
    # an assertion or a CUDA fault on one input (every in-flight request is lost; its pod restarts it).
    fault_crash_text: str | None = None
    max_queued_requests: int | None = None  # like SGLang --max-queued-requests: more waiting => 503
    api_key: str | None = None  # like SGLang --api-key: "Authorization: Bearer <key>" or 401 (/health, /metrics open)
    served_model_name: str | None = None  # metrics' model_name label; defaults to model_path
    trust_remote_code: bool = False  # like SGLang --trust-remote-code: run the tokenizer's own code (Kimi)
    # Like SGLang 0.5.23 --enable-return-aux-hidden-states (EAGLE3 convention) and --return-aux-hidden-state-layer-ids
    # (comma-separated here; None: the EAGLE3 default of the model's layer count); hidden_states.py serves them.
    enable_return_aux_hidden_states: bool = False
    # Like --enable-return-hidden-states: without aux capture, the final (post-norm) state of every position.
    enable_return_hidden_states: bool = False
    return_aux_hidden_state_layer_ids: str | None = None
    chunked_prefill_size: int = 8192  # like --chunked-prefill-size: prefill chunks of a hidden-state answer

    def __post_init__(self) -> None:
        try:
            supported = release(self.sglang_version).supported
        except UnknownReleaseError as error:
            raise ValueError(str(error)) from None
        if not supported:
            raise ValueError(f"the simulator shows the behaviour of the supported SGLang releases "
                             f"({', '.join(SUPPORTED_RELEASES)}), not {self.sglang_version}")
        if self.enable_return_aux_hidden_states and not release(self.sglang_version).aux_hidden_states:
            raise ValueError(f"SGLang {self.sglang_version} has no --enable-return-aux-hidden-states (0.5.23+)")
        if self.page_size < 1:
            raise ValueError("page_size must be at least 1")
        if self.profile != AUTO and self.profile not in PROFILES:
            raise ValueError(f"unknown profile {self.profile!r}; choose auto or one of {sorted(PROFILES)}")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be positive")
        if self.max_running_requests < 1 or self.max_total_tokens < 1:
            raise ValueError("max_running_requests and max_total_tokens must be at least 1")
        for name in ("fault_503_rate", "fault_reset_rate", "fault_abort_rate", "fault_slow_rate", "fault_nan_rate",
                     "fault_input_mismatch_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within [0, 1]")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path


_HELP = {
    "model_path": "folder with config.json, generation_config.json and tokenizer files",
    "sglang_version": f"the SGLang release whose behaviour to show: {', '.join(SUPPORTED_RELEASES)}",
    "page_size": "KV cache page size in tokens (SGLang --page-size)",
    "fault_503_after_s": "real seconds after start when /generate starts answering 503 for --fault-503-for-s",
    "fault_503_for_s": "real seconds during which every /generate answers 503 (a queue that stays full)",
    "fault_nan_rate": "share of requests whose output hits NaN logits (finish_reason matched 'NaN happened')",
    "seed": "seed of every drawn output (same seed + same prompt => same output)",
    "max_running_requests": "continuous-batching slots",
    "max_total_tokens": "KV cache pool in tokens (prompt + output reserved per running request)",
    "context_length": "context length (default: config.json max_position_embeddings)",
    "step_ms": "simulated decode step time in ms at an empty batch",
    "step_ms_per_request": "simulated ms added to each step per running request",
    "prefill_ms_per_1k_tokens": "simulated ms added to a step per 1000 prompt tokens it admits",
    "time_scale": "simulated seconds per real second (1000 => a 20 ms step takes 20 us)",
    "profile": "output-length profile: auto picks glaive (tools declared), swe (long prompt) or reasoning",
    "startup_seconds": "real seconds during which /health and /health_generate answer 503 (weight loading)",
    "fault_503_rate": "share of /generate requests answered 503",
    "fault_reset_rate": "share of /generate requests whose connection is dropped without an answer",
    "fault_abort_rate": "share of requests finishing with finish_reason type abort",
    "fault_slow_rate": "share of /generate requests delayed by --fault-slow-seconds",
    "fault_input_mismatch_rate": "share of answers whose echoed prompt_token_ids differ from the ids sent",
    "fault_slow_seconds": "real seconds of delay for slow requests",
    "fault_crash_text": "the process dies (every in-flight request lost) when a prompt contains this text",
    "max_queued_requests": "waiting-queue limit; newcomers beyond it get 503 (SGLang --max-queued-requests)",
    "api_key": "require 'Authorization: Bearer KEY' (SGLang --api-key)",
    "served_model_name": "model name in /metrics labels (default: the model path)",
    "return_aux_hidden_state_layer_ids": "comma-separated target layer ids to capture (default: EAGLE3's)",
    "chunked_prefill_size": "prefill chunk in tokens (SGLang --chunked-prefill-size)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per SimConfig field, plus --host and --port."""
    defaults = {f.name: f.default for f in fields(SimConfig)}
    parser.add_argument("--model-path", "--model", dest="model_path", required=True, help=_HELP["model_path"])
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    typed: dict[str, type] = {
        "sglang_version": str, "page_size": int, "fault_503_after_s": float, "fault_503_for_s": float,
        "fault_nan_rate": float, "seed": int, "max_running_requests": int, "max_total_tokens": int,
        "context_length": int, "step_ms": float, "step_ms_per_request": float, "prefill_ms_per_1k_tokens": float,
        "time_scale": float,
        "profile": str, "startup_seconds": float, "fault_503_rate": float, "fault_reset_rate": float,
        "fault_abort_rate": float, "fault_slow_rate": float, "fault_slow_seconds": float,
        "fault_input_mismatch_rate": float,
        "max_queued_requests": int, "api_key": str, "served_model_name": str, "fault_crash_text": str,
        "return_aux_hidden_state_layer_ids": str, "chunked_prefill_size": int,
    }
    parser.add_argument("--trust-remote-code", dest="trust_remote_code", action="store_true",
                        help="run the tokenizer's own Python code (SGLang --trust-remote-code), e.g. Kimi's")
    parser.add_argument("--enable-return-aux-hidden-states", dest="enable_return_aux_hidden_states",
                        action="store_true", help="serve EAGLE3 aux hidden states (SGLang 0.5.23+)")
    parser.add_argument("--enable-return-hidden-states", dest="enable_return_hidden_states", action="store_true",
                        help="serve the final hidden state (without aux capture; SGLang --enable-return-hidden-states)")
    for name, kind in typed.items():
        flag = "--" + name.replace("_", "-")
        choices = [AUTO, *sorted(PROFILES)] if name == "profile" else None
        default = defaults[name]
        shown = "" if default is None or name == "api_key" else f" (default {default})"
        parser.add_argument(flag, dest=name, type=kind, default=default, help=_HELP[name] + shown,
                            choices=choices)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(**{f.name: getattr(args, f.name) for f in fields(SimConfig)})
