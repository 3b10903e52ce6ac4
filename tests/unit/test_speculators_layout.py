"""`spec.hiddenStates.layouts: [speculators]`: accepted only where stock SGLang 0.5.23 serves speculators' pre-norm
final state in the aux pass itself, refused by name everywhere else.

speculators 0.9.0 reads `hidden_states[:, -1]` of each hs_{i}.safetensors as verifier_last_hidden_states and
`[:, :-1]` as the aux layers (speculators/train/data.py:325-334), and applies the verifier's norm to the former
before lm_head (models/eagle3/core.py:119-120, 251-252): it is the residual *before* the final norm. SGLang 0.5.23
captures that only on gpt_oss, whose final norm takes a capture hook for boundary L (models/gpt_oss.py:727-738),
with explicit id i at boundary i + 1 (gpt_oss.py:1346-1352) and every id below L
(model_runner_components/spec_aux_hidden_state.py:113-129): layerIds [1, L/2-1, L-4, L-1], one pass.
"""

from __future__ import annotations

import pytest

from tests.unit.test_planner import H200, facts, make_spec
from tokenmill_operator.decide.planner import PlanError, plan_server
from tokenmill_runner.facts.hidden_states import (
    check_layouts,
    kinds_needed,
    shape_from_config,
    speculators_layer_ids,
)
from tokenmill_runner.spec.resource import SpecError, parse_document

GPT_OSS_LAYERS = 36  # tests/fixtures/models/gpt-oss-120b.json
GPT_OSS_IDS = [1, 17, 32, 35]


def spec_document(states: dict) -> dict:
    return {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "t"},
            "spec": {"model": {"path": "/m"}, "datasets": [{"name": "a", "source": "/p/a.jsonl"}],
                     "output": {"uri": "/o"}, "hiddenStates": states}}


def test_the_layer_ids_are_the_eagle3_default_then_the_final_norm_s_input():
    assert speculators_layer_ids(GPT_OSS_LAYERS) == GPT_OSS_IDS
    assert speculators_layer_ids(8) == [1, 3, 4, 7]
    # No second pass: the final state is the last aux layer (SpecForge's post-norm one needs one).
    assert kinds_needed(["speculators"]) == ["aux"]
    assert kinds_needed(["speculators", "specforge"]) == ["aux", "final"]


def test_the_spec_accepts_the_layout_with_explicit_ascending_ids_only():
    spec = parse_document(spec_document({"layouts": ["speculators"], "layerIds": GPT_OSS_IDS})).spec
    assert spec.hidden_states is not None and spec.hidden_states.layouts == ["speculators"]
    # Without ids SGLang captures the EAGLE3 default, whose last layer is L - 4's output, not the final state.
    with pytest.raises(SpecError, match=r"hiddenStates.layouts 'speculators' needs explicit layerIds.*L - 1"):
        parse_document(spec_document({"layouts": ["speculators"]}))
    # The answer holds the layers in forward order whatever order they are given in (gpt_oss.py:711-738,
    # layers/aux_hidden_states.py:97-102), so the last id given must be the last one captured.
    with pytest.raises(SpecError, match=r"hiddenStates.layouts 'speculators' needs layerIds in ascending order"):
        parse_document(spec_document({"layouts": ["speculators"], "layerIds": [35, 1, 17, 32]}))


def plan(states: dict, model: str):
    spec = make_spec({"gpuProduct": H200})
    hidden_states = parse_document(spec_document(states)).spec.hidden_states
    return plan_server(spec.model_copy(update={"hidden_states": hidden_states}), facts(model))


def test_the_planner_accepts_gpt_oss_and_refuses_every_other_architecture():
    assert plan({"layouts": ["speculators"], "layerIds": GPT_OSS_IDS}, "gpt-oss-120b").tensor_parallel >= 1
    # Llama's final norm has no capture hook: id L - 1 would need boundary L, which it lacks
    # (layers/logits_processor.py:920-951), and its post-norm state cannot be turned back into the pre-norm one.
    with pytest.raises(PlanError, match=r"spec.hiddenStates.layouts 'speculators'.*GptOssForCausalLM.*"
                                        r"LlamaForCausalLM.*drop the layout"):
        plan({"layouts": ["speculators"], "layerIds": [1, 15, 28, 31]}, "llama-3.1-8b")
    with pytest.raises(PlanError, match=r"layouts 'speculators'.*KimiK25ForConditionalGeneration"):
        plan({"layouts": ["speculators"], "layerIds": [1, 30, 57, 60]}, "kimi-k2.5")
    # On gpt_oss, a last id other than L - 1 is an aux layer: named, with the ids to set.
    with pytest.raises(PlanError, match=r"last of layerIds to be 35.*layerIds: \[1, 17, 32, 35\]"):
        plan({"layouts": ["speculators"], "layerIds": [1, 17, 32, 34]}, "gpt-oss-120b")
    # The model's own layer count bounds the ids, as SGLang's check does (spec_aux_hidden_state.py:120-129).
    with pytest.raises(PlanError, match=r"spec.hiddenStates.layerIds \[40\] out of range"):
        plan({"layerIds": [1, 40]}, "gpt-oss-120b")


def test_the_capture_pass_checks_the_layout_against_config_json_too():
    # generate/hidden_pass.py reads the model's config.json and refuses before any capture request.
    gpt_oss = {"architectures": ["GptOssForCausalLM"], "num_hidden_layers": 8, "hidden_size": 64}
    assert shape_from_config(gpt_oss, [1, 3, 4, 7], "bfloat16", layouts=["speculators"]).layers == 4
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        shape_from_config({**gpt_oss, "architectures": ["LlamaForCausalLM"]}, [1, 3, 4, 7], "bfloat16",
                          layouts=["speculators"])
    with pytest.raises(ValueError, match="no named architecture"):
        check_layouts(["speculators"], [1, 3, 4, 7], None, 8)
    check_layouts(["specforge"], None, "LlamaForCausalLM", 8)  # other layouts are not this check's
