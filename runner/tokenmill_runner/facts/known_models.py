"""Model facts that ship with tokenmill, for planning before a model's own files can be read. Pure: reads only this
package's data/models.json.

`tokenmill plan` reads config.json and the safetensors index from spec.model.path; on a laptop without the store's
credentials, or before the weights are uploaded, it cannot. For the models the examples and docs name, the
package carries the published config.json and the checkpoint's size, each with where it came from, keyed by the
Hugging Face repository (`org/name`) the model path ends with: `s3://models/moonshotai/Kimi-K2.5/` is
`moonshotai/Kimi-K2.5`. The files win whenever they can be read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any


@dataclass(frozen=True)
class KnownModel:
    name: str  # the Hugging Face repository, e.g. moonshotai/Kimi-K2.5
    config: dict[str, Any]
    weight_bytes: int
    config_source: str
    weight_source: str

    def describe(self) -> str:
        return f"{self.name}: config {self.config_source}; weight size {self.weight_bytes:,} B, {self.weight_source}"


@cache
def _models() -> dict[str, KnownModel]:
    data = json.loads(resources.files(__package__).joinpath("data/models.json").read_text())
    return {name.lower(): KnownModel(name, entry["config"], int(entry["weight_bytes"]), entry["sources"]["config"],
                                     entry["sources"]["weight_bytes"])
            for name, entry in data["models"].items()}


def repository_of(path: str) -> str:
    """The `org/name` a model path ends with (`s3://models/moonshotai/Kimi-K2.5/` -> `moonshotai/Kimi-K2.5`)."""
    parts = [p for p in path.split("://", 1)[-1].split("/") if p]
    return "/".join(parts[-2:])


def known_model(*paths: str | None) -> KnownModel | None:
    """The shipped facts of the first path that ends with a model tokenmill knows, else None."""
    models = _models()
    for path in paths:
        if path and (found := models.get(repository_of(path).lower())) is not None:
            return found
    return None


def known_names() -> list[str]:
    return sorted(model.name for model in _models().values())
