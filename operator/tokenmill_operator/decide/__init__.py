"""decide: pure functions over plain data: the server plan (planner/), the lifecycle decision, the trial, the
hidden-state passes, policy, progress from markers, status, and the children as dicts (manifests, cache, kueue).

No I/O library, and neither observe nor act (pyproject.toml: the layers contract and "Pure modules import no I/O
library")."""
