"""The model facts that ship with tokenmill (facts/data/models.json) for planning without the model's files: found
by the repository a model path ends with, each with where its config and weight size come from, and the same
facts as the test fixture the planner is calibrated with."""

from __future__ import annotations

import json
from pathlib import Path

from tokenmill_runner.facts.known_models import known_model, known_names, repository_of
from tokenmill_runner.facts.model_facts import model_facts

REPO = Path(__file__).resolve().parents[2]


def test_a_model_path_is_matched_by_the_repository_it_ends_with_in_any_case():
    assert repository_of("s3://models/moonshotai/Kimi-K2.5/") == "moonshotai/Kimi-K2.5"
    assert known_model("s3://models/moonshotai/Kimi-K2.5/").name == "moonshotai/Kimi-K2.5"
    assert known_model("/mnt/weights/qwen/qwen3-8b").name == "Qwen/Qwen3-8B"
    assert known_model("s3://models/someone/Unknown-1B/") is None
    assert known_model(None, "s3://b/Qwen/Qwen3-8B/").name == "Qwen/Qwen3-8B"  # the tokenizer path, second


def test_every_example_and_readme_model_ships_with_its_sources():
    names = set(known_names())
    assert {"moonshotai/Kimi-K2.5", "Qwen/Qwen3-8B"} <= names
    for name in names:
        found = known_model(name)
        assert found is not None and found.config_source and found.weight_source
        facts = model_facts(found.config, found.weight_bytes)
        assert facts.num_layers > 0 and facts.weight_bytes == found.weight_bytes


def test_the_shipped_kimi_facts_are_the_calibration_fixture():
    fixture = json.loads((REPO / "tests" / "fixtures" / "models" / "kimi-k2.5.json").read_text())
    shipped = known_model("moonshotai/Kimi-K2.5")
    assert shipped is not None
    assert (shipped.config, shipped.weight_bytes) == (fixture["config"], fixture["weight_bytes"])
