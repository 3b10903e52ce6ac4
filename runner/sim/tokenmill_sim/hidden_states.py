"""The hidden states the simulator serves, as SGLang 0.5.23 shapes them: the aux layers
(--enable-return-aux-hidden-states) or, without aux capture and with --enable-return-hidden-states, the final
(post-norm) state, keyed as layer FINAL_LAYER_KEY. Pure.

Values are keyed by (token id, position, captured layer, column) and exact in bf16 (multiples of 1/64 within
[-2, 2)), so a reader can recompute what any position of any layer must hold and see a state shifted by one token
or taken from the wrong layer. The answer's shape follows facts/hidden_states.py: one [extend_len, layers * hidden]
block per prefill chunk, then one row per decoded token, cut to finished_len entries; positions served from the
prefix cache get no state.
"""

from __future__ import annotations

from dataclasses import dataclass


def keyed_value(token: int, position: int, layer: int, column: int) -> float:
    """The state value of one column: 8 significant bits at most, so bf16 holds it exactly."""
    mixed = (token * 7919 + position * 104_729 + layer * 1_299_709 + column * 15_485_863) % 256
    return (mixed - 128) / 64.0


def keyed_row(token: int, position: int, layer_ids: list[int], hidden: int) -> list[float]:
    """One position's states, the captured layers concatenated on the last axis as SGLang packs them."""
    return [keyed_value(token, position, layer, column) for layer in layer_ids for column in range(hidden)]


# The key of the final state's values: no captured layer id is negative, so a final state stored where an aux layer
# belongs (or the reverse) shows.
FINAL_LAYER_KEY = -1


@dataclass(frozen=True)
class StateCapture:
    """What the server was started with: the aux layer ids, or [FINAL_LAYER_KEY] for the final state."""

    # The explicit ids (the default resolved by facts.hidden_states.default_eagle3_layer_ids), each keying its values.
    # Id i is the output of layer i (boundary i + 1) on every model; on gpt_oss id L - 1 is boundary L, the input of
    # the final norm (0.5.23 models/gpt_oss.py:711-738, 1344-1352), so its key tells speculators' final state apart.
    # A model without that hook fails its first forward on id L - 1 (layers/logits_processor.py:920-951), which the
    # simulator does not play: tokenmill refuses the layout for it before any request (facts/hidden_states.py).
    layer_ids: list[int]
    hidden: int
    chunked_prefill_tokens: int


def hidden_states_entries(capture: StateCapture, input_ids: list[int], output_ids: list[int], cached: int,
                          finished_len: int) -> list[list[float] | list[list[float]]]:
    """meta_info.hidden_states of one request: prefill chunks over the uncached positions, then a row per decoded
    token except the last (its forward never runs), cut to finished_len entries (0.5.23
    batch_result_processor.py:641-702, output_streamer.py:668-675)."""
    entries: list[list[float] | list[list[float]]] = []
    chunk = max(1, capture.chunked_prefill_tokens)
    for start in range(cached, len(input_ids), chunk):
        stop = min(len(input_ids), start + chunk)
        entries.append([keyed_row(input_ids[p], p, capture.layer_ids, capture.hidden) for p in range(start, stop)])
    for index, token in enumerate(output_ids[:-1]):
        entries.append(keyed_row(token, len(input_ids) + index, capture.layer_ids, capture.hidden))
    return entries[:finished_len]
