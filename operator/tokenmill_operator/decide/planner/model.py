"""What planning needs from a model: the runner's ModelFacts (shared with the throughput model and the simulator),
with a config that cannot be planned for turned into a PlanError."""

from __future__ import annotations

from typing import Any

from tokenmill_runner.facts.model_facts import ModelConfigError, ModelFacts
from tokenmill_runner.facts.model_facts import model_facts as _parse

from .plan import PlanError

__all__ = ["ModelFacts", "model_facts"]


def model_facts(config: dict[str, Any], weight_bytes: int) -> ModelFacts:
    """Parse a config.json dict (multimodal wrappers included) and the total weight size into ModelFacts."""
    try:
        return _parse(config, weight_bytes)
    except ModelConfigError as error:
        raise PlanError(str(error)) from None
