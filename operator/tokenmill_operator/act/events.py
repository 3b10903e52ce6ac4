"""The pass's Events posted on the resource (through kopf, which names the object and rate-limits nothing itself)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import kopf

from ..decide.facts import Event


def post(body: dict[str, Any], events: Iterable[Event]) -> None:
    for event in events:
        # kopf.event reads any body mapping (kind, name, uid); its types name only kopf's own RawBody TypedDict
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)  # type: ignore[arg-type]
