"""What SGLang serves as the target's EAGLE-3 aux hidden states, as data and arithmetic. Pure.

Read from the 0.5.23 wheel (file:line in docs/sglang-release-facts.md, "Aux hidden states"):

- `--enable-return-aux-hidden-states` with `--speculative-algorithm EAGLE3` (the convention; reset to None, no
  draft loaded) and optionally `--return-aux-hidden-state-layer-ids` (arg_groups/fields/exec_.py:130-157,
  arg_groups/validation_hook.py:697-752). pp_size must be 1; explicit ids must be non-negative, unique and below
  num_hidden_layers (model_runner_components/spec_aux_hidden_state.py:113-129).
- Without ids, an EAGLE3 model captures the inputs of layers [2, L // 2, L - 3]; an explicit id i captures the
  input of layer i + 1, i.e. the output of layer i (models/llama.py:929-941, the same in qwen2.py:781, qwen3.py:778,
  qwen3_moe.py:1128, deepseek_v2.py:3458, glm4_moe.py:1269, gpt_oss.py:1337). So the default equals explicit ids
  [1, L // 2 - 1, L - 4].
- The states of a request come as `meta_info.hidden_states`: a JSON list whose entries are, in order, one
  [extend_len, layers * hidden] block of floats per prefill chunk, then one [layers * hidden] row per decoded
  token; the layers are concatenated on the last axis (layers/aux_hidden_states.py:97-102,
  layers/logits_processor.py:866-872, managers/scheduler_components/batch_result_processor.py:641-702). The values
  are the served dtype's, turned into Python floats (`.tolist()`), so a bf16 value survives JSON exactly.
- The list is cut to `finished_len` entries (managers/scheduler_components/output_streamer.py:668-675): a request
  with max_new_tokens 0 finishes with finished_len 0 and gets `[]`; with max_new_tokens k the first k entries
  survive, so k must be at least the number of prefill chunks.
- A prefix-cache hit is not recomputed, so its positions get no state; return_logprob with logprob_start_len 0
  caps the matched prefix at 0 (managers/schedule_batch.py:1766-1785).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import ceil
from typing import Literal

Convention = Literal["eagle3"]
StateDtype = Literal["bfloat16", "float16", "float32"]

StateStorage = Literal["served", "fp8"]

DTYPE_BYTES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
# safetensors' dtype names.
SAFETENSORS_DTYPE: dict[str, str] = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float8_e4m3fn": "F8_E4M3"}
# hs-connectors 0.9.0's fp8 layout (store/fp8.py): float8_e4m3fn values and one float32 scale per token.
FP8_DTYPE = "float8_e4m3fn"
FP8_SCALE_BYTES = 4

# Architectures whose 0.5.23 model class implements set_eagle3_layers_to_capture (any other fails at start:
# model_runner_components/attention_backend_setup.py:40-55). The models/*.py of each: llama.py:929 (its EntryClass,
# :968), qwen2.py:781, qwen3.py:778, qwen3_moe.py:1128, deepseek_v2.py:3458 (:3595), gpt_oss.py:1337,
# kimi_k25.py:928 (delegates to its language model), glm4_moe.py:1269 (:1433).
EAGLE3_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM", "Phi3ForCausalLM", "InternLM3ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
    "GptOssForCausalLM", "KimiK25ForConditionalGeneration", "Glm4MoeForCausalLM",
)


# What each trainer's offline layout reads besides the aux layers: the target's final hidden state. A 0.5.23 server
# with aux capture returns the aux layers in place of it (layers/logits_processor.py:866-872) and refuses a capture id
# >= num_hidden_layers (spec_aux_hidden_state.py:120-129), so no one request returns both (docs/export.md).
TRAINER_LAYOUTS: dict[str, str] = {
    "speculators": "speculators 0.9.0 reads hidden_states[:, -1] as verifier_last_hidden_states, the target's final "
                   "layer before its norm (speculators/train/data.py:310-334, models/eagle3/core.py:119-120)",
    "specforge": "SpecForge 0.2.0 reads hidden_state as the target's final state beside aux_hidden_state "
                 "(specforge/data/preprocessing.py:643-666)",
}
# SpecForge's final state is the one after the model's norm: its own capture wraps the logits processor
# (offline_capture/sglang_backend/utils.py:89-112) and training feeds it straight to lm_head
# (modeling/target/target_head.py:100-101). A server started with --enable-return-hidden-states and no aux flags
# returns exactly that (the models hand the normed states to the logits processor: llama.py:498-500,
# deepseek_v2.py:3239), in the same answer layout as the aux states. So it is served by a second pass against a
# server relaunched that way; FINAL_PASS_LAYOUTS are the layouts that need it.
FINAL_PASS_LAYOUTS: frozenset[str] = frozenset({"specforge"})
FINAL_STATE_WITH_AUX_FROM: str | None = None  # the first release that serves both in one request; none yet
# speculators' final state is the one *before* the norm (its training applies the verifier's norm before lm_head,
# models/eagle3/core.py:119-120, 251-252). A post-norm state cannot be turned back into it, but a model whose final
# norm takes a capture hook for boundary L serves it as one more aux layer, in the same request: on gpt_oss an
# explicit id i is boundary i + 1 (models/gpt_oss.py:1346-1352) and boundary L is the residual the final norm reads
# (gpt_oss.py:727-738; layers/layer_boundary/residual/access.py:40-54), captured after the layers' boundaries in
# forward order (gpt_oss.py:711-738, layers/aux_hidden_states.py:97-102). So id L - 1, last, is speculators'
# hidden_states[:, -1] and the ids before it its [:, :-1] (speculators/train/data.py:325-334); no second pass.
# minimax_m3 has the same hook (minimax_m3.py:1955-1964) but its id mapping is not read, so it is not listed.
AUX_LAST_LAYOUTS: frozenset[str] = frozenset({"speculators"})
PRE_NORM_FINAL_ARCHITECTURES: tuple[str, ...] = ("GptOssForCausalLM",)

ServedKind = Literal["aux", "final"]


def served_kind(server_args: dict[str, object]) -> ServedKind | None:
    """Which states a server's answers hold, from its /server_info ServerArgs: the aux layers when aux capture is
    on (it takes the place of the final state), else the final state with --enable-return-hidden-states."""
    if server_args.get("enable_return_aux_hidden_states"):
        return "aux"
    if server_args.get("enable_return_hidden_states"):
        return "final"
    return None


def kinds_needed(layouts: list[str]) -> list[ServedKind]:
    """The passes a spec's layouts need: always the aux layers, and the final state for SpecForge's layout."""
    return ["aux", "final"] if FINAL_PASS_LAYOUTS.intersection(layouts) else ["aux"]


def default_eagle3_layer_ids(num_layers: int) -> list[int]:
    """The explicit layer ids equal to SGLang's EAGLE3 default capture (inputs of layers 2, L//2, L-3)."""
    if num_layers < 4:
        raise ValueError(f"a model of {num_layers} layers has no EAGLE3 default capture (it needs at least 4)")
    return [1, num_layers // 2 - 1, num_layers - 4]


def speculators_layer_ids(num_layers: int) -> list[int]:
    """layerIds for speculators' layout on gpt_oss: the EAGLE3 default's layers, then id L - 1 (boundary L, the
    residual the final norm reads)."""
    return [*default_eagle3_layer_ids(num_layers), num_layers - 1]


def check_aux_last_layer_ids(layout: str, layer_ids: list[int] | None) -> None:
    """What the spec alone can check of an AUX_LAST_LAYOUTS layout: explicit, strictly ascending ids (the answer
    holds them in forward order, whatever order they are given in: gpt_oss.py:711-738, so the last given must be
    the last captured). The model's part is check_layouts."""
    if layer_ids is None:
        raise ValueError(f"layouts {layout!r} needs explicit layerIds ending with num_hidden_layers - 1 (the final "
                         "norm's input): set layerIds: [1, L/2 - 1, L - 4, L - 1] for a target of L layers")
    if any(b <= a for a, b in zip(layer_ids, layer_ids[1:], strict=False)):
        raise ValueError(f"layouts {layout!r} needs layerIds in ascending order (SGLang answers them in forward "
                         f"order and speculators reads the last as the final state), got {layer_ids}")


def check_layouts(layouts: Sequence[str], layer_ids: list[int] | None, architecture: str | None,
                  num_layers: int) -> None:
    """The layouts against the model's config.json: speculators' pre-norm final state is served only by an
    architecture whose final norm takes a capture hook, as the last id L - 1."""
    for layout in layouts:
        if layout not in AUX_LAST_LAYOUTS:
            continue
        check_aux_last_layer_ids(layout, layer_ids)
        assert layer_ids is not None
        if architecture not in PRE_NORM_FINAL_ARCHITECTURES:
            raise ValueError(
                f"layouts {layout!r}: {TRAINER_LAYOUTS[layout]}; SGLang 0.5.23 serves it only for "
                f"{', '.join(PRE_NORM_FINAL_ARCHITECTURES)} (its final norm takes a capture hook), and this model is "
                f"{architecture or 'of no named architecture'} (config.json architectures); drop the layout")
        if layer_ids[-1] != num_layers - 1:
            raise ValueError(
                f"layouts {layout!r} needs the last of layerIds to be {num_layers - 1} (num_hidden_layers - 1: the "
                f"final norm's input, speculators' verifier_last_hidden_states), got {layer_ids}; set layerIds: "
                f"{speculators_layer_ids(num_layers)}")


def check_layer_ids(layer_ids: list[int], num_layers: int) -> None:
    """SGLang's own checks on --return-aux-hidden-state-layer-ids, before a GPU hour is spent on them."""
    if not layer_ids:
        raise ValueError("layerIds must not be empty")
    if any(layer < 0 for layer in layer_ids):
        raise ValueError(f"layerIds must be non-negative, got {layer_ids}")
    if len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"layerIds must not repeat a layer, got {layer_ids}")
    out = [layer for layer in layer_ids if layer >= num_layers]
    if out:
        raise ValueError(f"layerIds {out} out of range for a target with {num_layers} layers")


def launch_flags(layer_ids: list[int] | None, kind: ServedKind = "aux") -> list[str]:
    """The SGLang flags that turn capture on (layer_ids None: the architecture's EAGLE3 default); for the final
    state's pass, only --enable-return-hidden-states (with the aux flags its answers would hold the aux layers)."""
    if kind == "final":
        return ["--enable-return-hidden-states"]
    flags = ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3"]
    if layer_ids is not None:
        flags += ["--return-aux-hidden-state-layer-ids", *(str(layer) for layer in layer_ids)]
    return flags


@dataclass(frozen=True)
class StateShape:
    layers: int
    hidden: int
    dtype: str  # the dtype the server computes and serves
    storage: str = "served"  # StateStorage: as served, or fp8 (hs-connectors' layout)

    @property
    def row_values(self) -> int:
        return self.layers * self.hidden

    @property
    def stored_dtype(self) -> str:
        return FP8_DTYPE if self.storage == "fp8" else self.dtype

    def value_bytes(self, tokens: int) -> int:
        """Bytes of the `hidden_states` tensor of `tokens` tokens, in the stored dtype."""
        return tokens * self.row_values * DTYPE_BYTES[self.stored_dtype]

    @property
    def bytes_per_token(self) -> int:
        """Stored bytes of one token's states: its values, and its scale when fp8."""
        return self.value_bytes(1) + (FP8_SCALE_BYTES if self.storage == "fp8" else 0)

    def state_bytes(self, tokens: int) -> int:
        """Bytes of the states of `tokens` tokens (the file adds its header and token ids: file_bytes)."""
        return tokens * self.bytes_per_token

    def file_bytes(self, tokens: int) -> int:
        """Bytes of one sample's companion file: states, the int64 token ids and a header (at most 1 KiB)."""
        return self.state_bytes(tokens) + 8 * tokens + 1024


def shape_from_config(config: dict[str, object], layer_ids: list[int] | None, dtype: str,
                      kind: ServedKind = "aux", layouts: Sequence[str] = (), storage: str = "served") -> StateShape:
    """The states' shape for a model's config.json (text_config for multimodal models) and the spec's layer ids;
    the final state is one layer. Raises ValueError when the ids or the layouts do not fit the model."""
    nested = config.get("text_config")
    text = nested if isinstance(nested, dict) else config
    layers, hidden = text.get("num_hidden_layers"), text.get("hidden_size")
    if not isinstance(layers, int) or not isinstance(hidden, int):
        raise ValueError("config.json names no num_hidden_layers and hidden_size: the states' shape is unknown")
    if kind == "final":
        return StateShape(1, hidden, dtype, storage)
    ids = layer_ids if layer_ids is not None else default_eagle3_layer_ids(layers)
    check_layer_ids(ids, layers)
    names = config.get("architectures") or text.get("architectures")
    check_layouts(layouts, layer_ids, names[0] if isinstance(names, list) and names else None, layers)
    return StateShape(len(ids), hidden, dtype, storage)


# Capture requests one runner worker keeps in flight (generate/hidden_capture.py); the plan times the pass with it.
CAPTURE_CONCURRENCY = 4


def capture_max_new_tokens(sequence_tokens: int, chunked_prefill_tokens: int) -> int:
    """max_new_tokens for a capture request: at least the prefill chunks it can be split into, since the answer
    keeps finished_len entries and each chunk is one (output_streamer.py:668-675); a chunk budget shared with other
    requests can split one more time."""
    return ceil(sequence_tokens / max(1, chunked_prefill_tokens)) + 1


def capture_request(sequence_ids: list[int], rid: str, chunked_prefill_tokens: int) -> dict[str, object]:
    """A /generate body whose answer holds the states of every position of `sequence_ids`: return_logprob with
    logprob_start_len 0 so no prefix is taken from the cache, ignore_eos so the chunks are not cut by an early
    stop, and the prompt's token ids echoed so they can be checked against the row's."""
    return {
        "input_ids": sequence_ids,
        "rid": rid,
        "sampling_params": {"max_new_tokens": capture_max_new_tokens(len(sequence_ids), chunked_prefill_tokens),
                            "temperature": 0.0, "ignore_eos": True},
        "return_hidden_states": True,
        "return_logprob": True,
        "logprob_start_len": 0,
        "return_prompt_token_ids": True,
    }


@dataclass(frozen=True)
class PlannedStates:
    """The states a run will store: bytes per dataset (samples x mean sequence tokens x bytes per token)."""

    shape: StateShape
    per_dataset: dict[str, int]
    tokens: dict[str, float]

    @property
    def total(self) -> int:
        return sum(self.per_dataset.values())


def plan_states(shape: StateShape, datasets: list[tuple[str, int, float]]) -> PlannedStates:
    """datasets: (name, samples, mean prompt + output tokens per sample)."""
    per = {name: shape.file_bytes(0) * samples + round(samples * tokens) * (shape.bytes_per_token + 8)
           for name, samples, tokens in datasets}
    return PlannedStates(shape, per, {name: samples * tokens for name, samples, tokens in datasets})


class NoRoomError(ValueError):
    """The output cannot hold the states the run will store."""


def check_room(needed: int, free: int, where: str) -> None:
    if needed > free:
        raise NoRoomError(f"{where} has {free / 1e9:.2f} GB free but the hidden states need {needed / 1e9:.2f} GB "
                          "(tokens x layers x hidden x dtype size, docs/planning.md); free space or use an s3:// output "
                          "before any GPU hour is spent")
