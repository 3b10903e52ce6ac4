"""The hidden-state capture pass (spec.hiddenStates) in the plan: the time it adds to the ETA and GPU-hours. Pure.

After the stream, generate/hidden_capture.py sends every committed sample once more: its prompt + output ids as one
request with no cached prefix (return_logprob from position 0), max_new_tokens = its prefill chunks + 1
(facts/hidden_states.capture_max_new_tokens), CAPTURE_IN_FLIGHT at a time per runner worker, every worker to the
first server URL it was given (generate/hidden_pass.py): one replica serves the pass while every replica holds its
GPUs.

Two bounds, and the pass takes the longer:

- The server's forwards, by the planner's own model: `workload.simulate` over those requests with the layout's
  decode step and chunked prefill (throughput.StepModel), the same functions the generation's ETA uses. The
  prefill's GEMMs already count the LM head on every token (ModelFacts.active_params_per_token), which is what
  input logprobs from position 0 cost.
- The states' bytes through the runner. SGLang sends them only as JSON float lists (`.tolist()`,
  managers/scheduler_components/batch_result_processor.py:659 in 0.5.23), about 4.3 characters of text per state
  byte, and each runner worker parses its answers on one core: docs/export.md measures 5.5-7.1 MB/s of states
  through the runner (hack/bench/bench_hidden_states.py). The low figure is the rate: that bench ran its server on
  the same 2 cores, but the real server's side is no cheaper (the scheduler's `.tolist()` and the HTTP process's
  JSON encoding are single-threaded too), so it is not raised. At this rate the bytes, not the GPU, bound the pass
  by far (an 8B model on an H200: ~0.06 ms of prefill per token against ~4.5 ms of JSON for its 24 KiB of states);
  the plan shows both and which binds, so a faster path (more workers, a binary answer) shows in the figure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from tokenmill_runner.facts.hidden_states import CAPTURE_CONCURRENCY, capture_max_new_tokens
from tokenmill_runner.facts.workload import simulate

# Layers SGLang's EAGLE3 default captures at any depth (facts/hidden_states.default_eagle3_layer_ids).
EAGLE3_LAYERS = 3
# Requests in flight per runner worker: capture_dataset's default, which generate/hidden_pass.py keeps.
CAPTURE_IN_FLIGHT = CAPTURE_CONCURRENCY
# States bytes per second one runner worker takes in (parse + write), docs/export.md's capture figure at 100 samples.
JSON_STATE_BYTES_PER_S = 5.5e6
# Requests simulated per dataset; all of one dataset's capture requests have its mean length, so a few hundred
# reach the steady state and the rest scale linearly.
SIMULATED = 256


@dataclass(frozen=True)
class CaptureLoad:
    """One dataset's share of the pass: its samples and their mean prompt + output tokens."""

    name: str
    samples: int
    sequence_tokens: float


@dataclass(frozen=True)
class CaptureTime:
    forward_seconds: float  # the server's prefill forwards and decode steps (the step model)
    transfer_seconds: float  # the states' JSON through the runner workers at JSON_STATE_BYTES_PER_S each
    state_bytes: float
    # SpecForge's final-state pass (facts/hidden_states.FINAL_PASS_LAYOUTS): the same requests again, after the
    # server's relaunch, one layer of states each. It runs after this one, so its time adds.
    final: CaptureTime | None = None

    @property
    def seconds(self) -> float:
        return max(self.forward_seconds, self.transfer_seconds) + (self.final.seconds if self.final else 0.0)

    @property
    def bound(self) -> str:
        return "json" if self.transfer_seconds >= self.forward_seconds else "prefill"


def capture_time(loads: Sequence[CaptureLoad], bytes_per_token: int, workers: int, chunk_tokens: int,
                 step_seconds: Callable[[int, float], float], prefill_seconds: Callable[[float, float], float],
                 in_flight: int = CAPTURE_IN_FLIGHT,
                 json_bytes_per_s: float = JSON_STATE_BYTES_PER_S) -> CaptureTime:
    """The pass on one replica: `step_seconds(batch, context_tokens)` and `prefill_seconds(tokens, prompt_tokens)`
    are the layout's (StepModel.step_seconds, StepModel.chunked_prefill_seconds); `chunk_tokens` its prefill
    chunk; `bytes_per_token` the states' (layers x hidden x dtype bytes)."""
    slots = max(1, in_flight * max(1, workers))
    forward = 0.0
    for load in loads:
        if load.samples <= 0:
            continue
        tokens = max(1, round(load.sequence_tokens))
        new = capture_max_new_tokens(tokens, chunk_tokens)
        simulated = min(load.samples, SIMULATED)
        seconds = simulate([(tokens, new)] * simulated, slots, partial(_step_at, step_seconds, tokens),
                           prefill_seconds)
        forward += seconds * load.samples / simulated
    state_bytes = sum(load.samples * load.sequence_tokens for load in loads) * bytes_per_token
    transfer = state_bytes / (json_bytes_per_s * max(1, workers))
    return CaptureTime(forward_seconds=forward, transfer_seconds=transfer, state_bytes=state_bytes)


def _step_at(step_seconds: Callable[[int, float], float], context_tokens: float, batch: int) -> float:
    return step_seconds(batch, context_tokens)
