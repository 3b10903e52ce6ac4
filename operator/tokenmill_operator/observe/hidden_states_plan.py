"""`tokenmill plan`'s hidden-state section: the bytes the run's states will take (per dataset and in all), and a
local output refused when its disk cannot hold them, before any GPU hour."""

from __future__ import annotations

import shutil
from pathlib import Path

from tokenmill_runner.facts.hidden_states import (
    NoRoomError,
    PlannedStates,
    StateShape,
    check_room,
    kinds_needed,
    plan_states,
    shape_from_config,
)
from tokenmill_runner.facts.workload import Workload
from tokenmill_runner.spec.resource import DatasetGenerationSpec

from .model_files import read_model_config


class HiddenStatesPlanError(ValueError):
    """The states cannot be planned or stored as the spec asks."""


def hidden_states_plan(spec: DatasetGenerationSpec, work: Workload, location: str | None) -> PlannedStates | None:
    if spec.hidden_states is None:
        return None
    try:
        shape = shape_from_config(read_model_config(spec, None, location), spec.hidden_states.layer_ids,
                                  spec.hidden_states.dtype, layouts=spec.hidden_states.layouts,
                                  storage=spec.hidden_states.storage)
    except ValueError as error:
        raise HiddenStatesPlanError(f"spec.hiddenStates: {error}") from None
    loads = [(d.name, d.samples, d.prompt_tokens + d.mean_output()) for d in work.datasets]
    planned = plan_states(shape, loads)
    if "final" in kinds_needed(list(spec.hidden_states.layouts)):
        # SpecForge's final state: one more file per sample, one layer wide (store/hidden_states.FINAL).
        final = plan_states(StateShape(1, shape.hidden, shape.dtype, shape.storage), loads)
        planned = PlannedStates(shape, {name: size + final.per_dataset[name] for name, size in
                                        planned.per_dataset.items()}, planned.tokens)
    uri = spec.output.uri.removeprefix("file://")
    if "://" not in uri:
        folder = Path(uri).resolve()
        while not folder.exists():
            folder = folder.parent
        try:
            check_room(planned.total, shutil.disk_usage(folder).free, f"the output {spec.output.uri}")
        except NoRoomError as error:
            raise HiddenStatesPlanError(f"spec.hiddenStates: {error}") from None
    return planned


def render_hidden_states(planned: PlannedStates) -> str:
    shape = planned.shape
    stored = (f"{shape.dtype} stored as {shape.stored_dtype} with a float32 scale per token"
              if shape.storage == "fp8" else shape.dtype)
    lines = [f"# Hidden states: {shape.layers} layers x {shape.hidden} hidden x {stored} = "
             f"{shape.bytes_per_token:,} bytes per token (+ 8 for its id)"]
    for name, size in planned.per_dataset.items():
        lines.append(f"  {name}: {planned.tokens[name]:,.0f} tokens -> {size / 1e9:,.2f} GB")
    lines.append(f"  total: {planned.total / 1e9:,.2f} GB")
    return "\n".join(lines)
