"""What one /generate request comes to, and how SGLang's answer body becomes it. Pure: no HTTP here.

The client (`client.py`) sends the request and retries; the row builder (`rows.py`) turns a result into a row or
an error record. Both depend on these types, so neither needs the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Generation:
    output_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # stop | length
    matched_stop: int | None
    latency_s: float
    attempts: int
    server: str


@dataclass(frozen=True)
class GenerationFailure:
    reason: str  # retries_exhausted | server_rejected | output_mismatch | bad_response
    message: str
    attempts: int


class Retry(Exception):
    """An attempt failed in a way another attempt may fix (an abort, a dropped connection, a 5xx)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def parse_generation(body: Any, server: str, attempts: int) -> Generation | GenerationFailure:
    """Check one /generate answer; raise Retry for an abort, return a failure for a malformed answer."""
    if not isinstance(body, dict) or "meta_info" not in body:
        return GenerationFailure("bad_response", f"{server}: /generate answered without meta_info", attempts)
    meta = body["meta_info"]
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type")
    if kind == "abort":
        raise Retry(f"{server}: request aborted: {finish.get('message', 'no message')}")
    output_ids = body.get("output_ids")
    if output_ids is None:
        return GenerationFailure(
            "bad_response",
            f"{server}: /generate returned no output_ids; SGLang <= v0.4.10 needs --skip-tokenizer-init, "
            "newer versions return them by default",
            attempts,
        )
    completion = int(meta.get("completion_tokens", -1))
    if len(output_ids) != completion:
        return GenerationFailure(
            "output_mismatch",
            f"{server}: len(output_ids)={len(output_ids)} but completion_tokens={completion}; SGLang "
            "v0.5.0-v0.5.4.post2 prepends prompt tokens to output_ids: use v0.5.5 or newer",
            attempts,
        )
    matched = finish.get("matched")
    return Generation(
        output_ids=output_ids,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        completion_tokens=completion,
        finish_reason=str(kind),
        matched_stop=matched if isinstance(matched, int) else None,
        latency_s=float(meta.get("e2e_latency", 0.0)),
        attempts=attempts,
        server=server,
    )


class ServersUnavailable(RuntimeError):
    """No server was live for longer than the outage budget. The run stops (`tokenmill run` exits 4) and writes
    nothing off: the samples in flight or not yet sent stay not done, and a rerun or a restarted pod continues.
    The client raises it; the pipeline stops on it."""
