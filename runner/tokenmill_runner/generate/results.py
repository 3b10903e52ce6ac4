"""What one /generate attempt comes to, and how SGLang's answer (status and body) becomes it. Pure: no HTTP here.

Every answer a supported SGLang release can give is one of: a `Generation`; or an `AttemptFailed` that says whose
fault it is, because the client treats them differently (docs/sglang-releases.md has the table per release):
- `SAMPLE`: this sample's answer is unusable (NaN, an abort, a malformed body). Retried, on another replica when
  there is one, and counted against the sample's attempts; recorded when it persists.
- `REPLICA`: the replica failed (HTTP 5xx, a dropped connection). Retried elsewhere; counted against the sample only
  once the replica answers other requests without having gone down in between (then the failure was plausibly the
  sample's own, an abort of that request alone); a replica that died never counts.
- `UNREACHABLE`: nothing answers at that address (connection refused): the replica is down.
- `OVERLOAD`: 503 or 429 (a full queue, a server starting or stopping), or a gateway saying it has no live worker
  for the request (below). Never counted against the sample.
- `FINAL`: the server refused this input (HTTP 400) or answered in a way no retry changes: recorded now.
- `FATAL`: wrong API key or URL: the run stops.

The client (`client.py`) sends and retries; the row builder (`rows.py`) turns a result into a row or an error
record. Both depend on these types, so neither needs the other.
"""

from __future__ import annotations

import enum
import struct
from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

# finish_reason.matched when a sampled id fell outside the vocabulary: SGLang overwrote that token with an
# end-of-sequence id and finished the request (0.5.9 managers/schedule_batch.py:1056-1070; 0.5.23
# managers/schedule_batch.py:1989), so the answer looks like a clean stop but its last token was never sampled.
NAN_MATCHED = "NaN happened"
MESSAGE_LIMIT = 300
# smg's own error codes (routers/error.rs create_error: {"error": {"code", ...}} and an X-SMG-Error-Code header) that
# say no worker could take the request: none registered (404 model_not_found, "No worker available for model", when
# the registry is empty: routers/http/router.rs route_typed_request), none healthy or every circuit breaker open
# (503 no_available_workers / no_workers), or the chosen worker refused the connection (500
# call_upstream_connection_failed: router.rs convert_reqwest_error). Like a dead replica: an outage, not the sample's
# failure, and not a wrong URL.
GATEWAY_NO_WORKER_CODES = frozenset({"model_not_found", "no_available_workers", "no_workers", "no_healthy_worker_pair",
                                     "call_upstream_connection_failed"})


@dataclass(frozen=True)
class Generation:
    output_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # stop | length
    matched_stop: int | None
    latency_s: float
    attempts: int  # requests sent for this sample, this one included
    server: str
    retractions: int = 0  # meta_info total_retractions (<= 0.5.11) / num_retractions (0.5.12.post1+)
    cached_tokens: int = 0  # prompt tokens SGLang found in its prefix cache
    reasoning_tokens: int | None = None  # meta_info.reasoning_tokens (0.5.10.post1+), SGLang's own count
    # output_ids as the check read them, 4 bytes an id: what the shard stores (no second conversion of the list)
    packed_ids: array[int] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class GenerationFailure:
    """A sample's final failure: recorded as an error with this reason (reason codes are stable strings)."""

    reason: str
    message: str
    attempts: int


class ServersUnavailable(RuntimeError):
    """No server was live for longer than the outage budget. The run stops (`tokenmill run` exits 4) and writes
    nothing off: the samples in flight or not yet sent stay not done, and a rerun or a restarted pod continues.
    The client raises it; the pipeline stops on it."""


class Fault(enum.Enum):
    SAMPLE = "sample"
    REPLICA = "replica"
    UNREACHABLE = "unreachable"
    OVERLOAD = "overload"
    FINAL = "final"
    FATAL = "fatal"


@dataclass(frozen=True)
class AttemptFailed:
    """One attempt that produced no usable generation."""

    fault: Fault
    reason: str  # the error record's reason if this stays the sample's last failure
    message: str  # names the server and what it said
    dropped: bool = False  # the request reached the server and its connection broke without an answer


def parse_generation(body: Any, server: str, attempts: int, vocab_size: int | None = None,
                     sent_ids: list[int] | None = None) -> Generation | AttemptFailed:
    """Check one HTTP 200 /generate answer (a single, non-streamed request); `vocab_size` (the tokenizer's) catches
    output ids no tokenizer can decode; `sent_ids` (when the request asked for return_prompt_token_ids) must be what
    the server echoes as prompt_token_ids."""
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        return AttemptFailed(Fault.SAMPLE, "bad_response", f"{server}: /generate answered without meta_info")
    meta = body["meta_info"]
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict):
        return AttemptFailed(Fault.SAMPLE, "bad_response", f"{server}: /generate answered without finish_reason")
    kind = finish.get("type")
    if kind == "abort":
        return aborted(finish, server)
    if kind not in ("stop", "length"):
        return AttemptFailed(Fault.SAMPLE, "bad_response", f"{server}: unknown finish_reason type {kind!r}")
    matched = finish.get("matched")
    if matched == NAN_MATCHED:
        return AttemptFailed(
            Fault.SAMPLE, "nan_output",
            f"{server}: finish_reason.matched is {NAN_MATCHED!r}: the model sampled an id outside the vocabulary "
            "(NaN logits) and SGLang replaced it with an end-of-sequence token, so the answer is corrupt")
    if sent_ids is not None:
        mismatch = input_mismatch(body.get("prompt_token_ids"), sent_ids, server)
        if mismatch is not None:
            return mismatch
    return _generation(body, meta, str(kind), matched, server, attempts, vocab_size)


def input_mismatch(echoed: Any, sent: list[int], server: str) -> AttemptFailed | None:
    """The server generated from other ids than it echoes having got (a proxy that re-encodes, a tokenizer that rewrites
    input_ids): the row would pair our prompt with an answer to another. FINAL like output_mismatch: resending the
    same ids to the same path changes nothing; the slot is given up (retryable once the path is fixed)."""
    if echoed is None or echoed == sent:  # no echo (a replica of an older release joined): nothing to compare
        return None
    if not isinstance(echoed, list):
        where = "prompt_token_ids is not a list"
    else:
        at = next((i for i, (a, b) in enumerate(zip(echoed, sent, strict=False)) if a != b), min(len(echoed), len(sent)))
        where = (f"{len(echoed)} ids echoed for {len(sent)} sent, first difference at position {at} "
                 f"(sent {sent[at] if at < len(sent) else 'nothing'}, echoed "
                 f"{echoed[at] if at < len(echoed) else 'nothing'})")
    return AttemptFailed(
        Fault.FINAL, "input_mismatch",
        f"{server}: the server generated from other prompt ids than were sent ({where}): a proxy or the server "
        "re-encoded the prompt; send input_ids to SGLang unchanged")


def _generation(body: dict[str, Any], meta: dict[str, Any], kind: str, matched: Any, server: str,
                attempts: int, vocab_size: int | None) -> Generation | AttemptFailed:
    output_ids = body.get("output_ids")
    if output_ids is None:
        return AttemptFailed(
            Fault.FINAL, "bad_response",
            f"{server}: /generate returned no output_ids; SGLang <= 0.4.10 returns them only with "
            "--skip-tokenizer-init: run a supported release (0.5.9 or newer)")
    packed: array[int] | None = None
    try:  # every id a 32-bit integer, checked in C: a Python loop over them cost ~0.1 ms a sample on the runner's loop
        # (struct packs a list of ints at a third of array("i", ...)'s cost; where it refuses one, the array says why)
        packed = array("i", struct.pack(f"{len(output_ids)}i", *output_ids)) if isinstance(output_ids, list) else None
    except struct.error:
        try:
            packed = array("i", output_ids)
        except OverflowError:  # an integer past 32 bits: no tokenizer's, checked against the vocabulary below
            packed = None
        except TypeError:
            return AttemptFailed(Fault.SAMPLE, "bad_response", f"{server}: output_ids is not a list of integers")
    if packed is None and not (isinstance(output_ids, list) and all(type(token) is int for token in output_ids)):
        return AttemptFailed(Fault.SAMPLE, "bad_response", f"{server}: output_ids is not a list of integers")
    checked = np.frombuffer(packed, dtype=np.int32) if packed is not None else np.array(output_ids, dtype=object)
    if packed is None and vocab_size is None:
        vocab_size = 1 << 31  # the shard stores 32-bit ids
    if vocab_size is not None and checked.size and _outside(checked, vocab_size, packed is not None):
        bad = next(t for t in output_ids if not 0 <= t < vocab_size)
        # Through 0.5.17 the length check runs before the vocabulary check
        # (0.5.9 managers/schedule_batch.py:1081-1086): a NaN on the last allowed token finishes as `length` with
        # the bad id left in place.
        return AttemptFailed(
            Fault.SAMPLE, "nan_output",
            f"{server}: output id {bad} is outside the tokenizer's vocabulary ({vocab_size} ids): the model "
            "sampled from NaN logits and SGLang let it through, so the answer is corrupt")
    completion = _int(meta.get("completion_tokens"), -1)
    if len(output_ids) != completion:
        return AttemptFailed(
            Fault.FINAL, "output_mismatch",
            f"{server}: len(output_ids)={len(output_ids)} but completion_tokens={completion}; SGLang "
            "0.5.0-0.5.4.post2 prepends up to 5 prompt tokens to output_ids: run a supported release (0.5.9 or "
            "newer)")
    return Generation(
        output_ids=output_ids,
        prompt_tokens=_int(meta.get("prompt_tokens"), 0),
        completion_tokens=completion,
        finish_reason=kind,
        matched_stop=matched if type(matched) is int else None,
        latency_s=float(meta.get("e2e_latency") or 0.0),
        attempts=attempts,
        server=server,
        # The key was renamed in 0.5.12.post1 (0.5.11 managers/tokenizer_manager.py:1666 total_retractions;
        # 0.5.12.post1 managers/tokenizer_manager.py:1687 num_retractions): either is read.
        retractions=_int(meta.get("num_retractions", meta.get("total_retractions")), 0),
        cached_tokens=_int(meta.get("cached_tokens"), 0),
        reasoning_tokens=meta.get("reasoning_tokens") if type(meta.get("reasoning_tokens")) is int else None,
        packed_ids=packed,
    )


def _outside(ids: np.ndarray, vocab_size: int, packed: bool) -> bool:
    """Whether an id is negative or past the vocabulary; for 32-bit ids in one reduction (read unsigned, a negative
    id is past any vocabulary of up to 2^31 ids)."""
    if packed and vocab_size <= 1 << 31:
        return int(ids.view(np.uint32).max()) >= vocab_size
    return int(ids.max()) >= vocab_size or int(ids.min()) < 0


def _int(value: Any, default: int) -> int:
    return value if type(value) is int else default


def aborted(finish: dict[str, Any], server: str) -> AttemptFailed:
    """finish_reason {type: abort}: an abort whose status the release did not turn into an HTTP error (no status:
    /abort_request, a paused engine; other statuses up to 0.5.22). Classified by its status like an HTTP error."""
    message = f"{server}: request aborted: {finish.get('message') or 'no message'}"
    status = finish.get("status_code")
    if type(status) is int and 400 <= status < 600:
        return _by_status(status, message)
    return AttemptFailed(Fault.SAMPLE, "retries_exhausted", message)


def classify_error(status: int, content: bytes, server: str) -> AttemptFailed:
    """An HTTP error answer from /generate, whichever body shape the release (or a gateway in front) uses."""
    message = f"{server}: HTTP {status}: {error_message(content) or 'no body'}"
    code = gateway_error_code(content)
    if code in GATEWAY_NO_WORKER_CODES:
        return AttemptFailed(Fault.OVERLOAD, "retries_exhausted", f"{message} (the gateway has no live worker for "
                             f"it: {code})")
    return _by_status(status, message)


def gateway_error_code(content: bytes) -> str | None:
    """smg's error code in an error body ({"error": {"type", "code", "message"}}), None in any other body (SGLang
    answers {"error": {"message"}} without a code, or {"object": "error", "code": <int>})."""
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def _by_status(status: int, message: str) -> AttemptFailed:
    if status in (401, 403):
        return AttemptFailed(Fault.FATAL, "unauthorized", f"{message} (check the server API key)")
    if status == 404:
        return AttemptFailed(Fault.FATAL, "not_found", f"{message} (check the server URL)")
    if status in (429, 503):
        return AttemptFailed(Fault.OVERLOAD, "retries_exhausted", message)
    if status >= 500:
        return AttemptFailed(Fault.REPLICA, "retries_exhausted", message)
    return AttemptFailed(Fault.FINAL, "server_rejected", message)


def transport_failure(server: str, error: str, detail: str, *, connect: bool) -> AttemptFailed:
    """No HTTP answer: refused/unresolvable (nothing listens: the replica is down) or dropped on the way."""
    fault = Fault.UNREACHABLE if connect else Fault.REPLICA
    return AttemptFailed(fault, "retries_exhausted", f"{server}: {error}: {detail or 'connection failed'}",
                         dropped=not connect)


def error_message(content: bytes) -> str:
    """The message of an error body, in any of the shapes SGLang answers with:
    {"error": {"message": ...}} (a ValueError, 0.5.9 entrypoints/http_server.py:1636), {"error": "..."} (401,
    utils/auth.py; the 0.5.22+ JSON contract gate, 0.5.23 entrypoints/http_server.py:937), an ErrorResponse
    {"object": "error", "message": ...} (HTTPException, 0.5.23 entrypoints/http_server.py:578), FastAPI's
    {"detail": ...}, or Starlette's plain-text "Internal Server Error" (an uncaught TypeError)."""
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        return content.decode("utf-8", "replace").strip()[:MESSAGE_LIMIT]
    if isinstance(body, dict):
        for key in ("error", "message", "detail"):
            value = body.get(key)
            if isinstance(value, dict) and value.get("message"):
                return str(value["message"])[:MESSAGE_LIMIT]
            if isinstance(value, str) and value:
                return value[:MESSAGE_LIMIT]
    return str(body)[:MESSAGE_LIMIT]
