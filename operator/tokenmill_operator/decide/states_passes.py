"""The hidden-state passes of a run whose layouts need two. Pure.

A stock SGLang 0.5.23 server returns the aux layers *in place of* the final hidden state, and only a server started
with --enable-return-hidden-states alone serves the final one (facts/hidden_states.py has the source lines). So
SpecForge's offline layout is captured in two passes: the server with aux capture and a runner Job that generates
every sample and captures its aux layers, then, once that Job has settled every sample, the same server relaunched
for the final state and a new runner Job that captures only that (it generates nothing: every sample is committed).

The pass is the operator's to remember (status.statesPass). It is part of the server's flags and of the runner
Job's hash, so a new pass rolls the StatefulSet and replaces the Job, like a layout switch. It is kept for one
planned generation and one retry: a spec edit or a retry may generate new samples, which need their aux layers, so
the run starts again from the first pass; each pass captures only what is still missing.
"""

from __future__ import annotations

from datetime import datetime

from tokenmill_runner.facts.hidden_states import ServedKind, kinds_needed
from tokenmill_runner.spec.resource import DatasetGenerationSpec

from .status import DatasetGenerationStatus, StatesPass


def passes_of(spec: DatasetGenerationSpec) -> tuple[ServedKind, ...]:
    """The passes the spec's layouts need, in order, when they are more than one (else empty: a single aux pass
    runs inside the one runner Job as it always has, with no pass of its own to remember)."""
    if spec.hidden_states is None:
        return ()
    kinds = kinds_needed(list(spec.hidden_states.layouts))
    return tuple(kinds) if len(kinds) > 1 else ()


def run_key(planned_generation: int, retry_token: str) -> str:
    return f"{planned_generation}:{retry_token}"


def current_pass(previous: DatasetGenerationStatus, passes: tuple[ServedKind, ...], run: str,
                 now: datetime) -> StatesPass | None:
    """The pass in progress: the remembered one while it is for this run, else the first (starting now)."""
    if not passes:
        return None
    kept = previous.states_pass
    if kept is not None and kept.run == run and kept.kind in passes:
        return kept
    return StatesPass(kind=passes[0], run=run, since=now.isoformat().replace("+00:00", "Z"))


def next_pass(passes: tuple[ServedKind, ...], current: StatesPass | None) -> ServedKind | None:
    """The pass after the current one, or None when it is the last (or there are none)."""
    if current is None:
        return None
    index = passes.index(current.kind)
    return passes[index + 1] if index + 1 < len(passes) else None
