"""Every answer a /generate request can get, per supported SGLang release, built from that release's source.

Each `Answer` is one HTTP status and body as the release produces them; `expect` is what the client must make of
it. Citations are the wheel's `sglang/srt/...` file:line, for the first supported release (0.5.9) and the latest
(0.5.23) or the release where the behaviour changes; releases.py holds the change points (see
docs/sglang-release-facts.md). Legacy answers (releases before the supported range) are kept, as a deployment may
still point the runner at one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill_runner.facts.releases import SUPPORTED_RELEASES, Release, release

PROMPT = [5, 6, 7]
EOS = 4
VOCAB = 1000


@dataclass(frozen=True)
class Answer:
    name: str
    status: int
    body: dict[str, Any] | str
    source: str
    # "generation" or the fault class (results.Fault value); for a generation the fields to check.
    expect: str
    reason: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)

    @property
    def content_type(self) -> str:
        return "text/plain" if isinstance(self.body, str) else "application/json"


def meta(facts: Release, finish: dict[str, Any], completion: int, retractions: int = 0,
         cached: int = 0) -> dict[str, Any]:
    """meta_info of a finished request: id, finish_reason, prompt_tokens, weight_version, the retraction counter
    (total_retractions through 0.5.11, 0.5.11 managers/tokenizer_manager.py:1666; num_retractions from 0.5.12.post1,
    0.5.12.post1 managers/tokenizer_manager.py:1687), reasoning_tokens (0.5.10.post1+, 0.5.10.post1
    managers/tokenizer_manager.py:1577), completion_tokens, cached_tokens, e2e_latency (0.5.9
    managers/tokenizer_manager.py:1495-1499, 2168-2174; 0.5.23 managers/tokenizer_manager.py:2510-2557,
    3604-3628)."""
    out: dict[str, Any] = {"id": "2b7f", "finish_reason": finish, "prompt_tokens": len(PROMPT),
                           "weight_version": "default", facts.retractions_key: retractions}
    if facts.has_reasoning_tokens:
        out["reasoning_tokens"] = 0
    out.update({"completion_tokens": completion, "cached_tokens": cached, "e2e_latency": 2.5})
    return out


def ok(facts: Release, output_ids: list[int], finish: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    return {"text": "…", "output_ids": output_ids, "meta_info": meta(facts, finish, len(output_ids), **kwargs)}


def value_error(message: str) -> dict[str, Any]:
    """A ValueError in /generate: {"error": {"message"}} (0.5.9 entrypoints/http_server.py:1636; 0.5.23
    entrypoints/http_server.py:2246)."""
    return {"error": {"message": message}}


def error_response(status: int, message: str) -> dict[str, Any]:
    """fastapi.HTTPException rendered as SGLang's ErrorResponse (0.5.9 entrypoints/http_server.py:399-405; 0.5.23
    entrypoints/http_server.py:625)."""
    return {"object": "error", "message": message, "type": str(status), "param": None, "code": status}


def abort(message: str | None, status_code: int | None) -> dict[str, Any]:
    """FINISH_ABORT.to_json (0.5.9 managers/schedule_batch.py:179-192; 0.5.23 managers/schedule_batch.py:332)."""
    return {"type": "abort", "message": message or "Aborted", "status_code": status_code, "err_type": None}


def answers(version: str) -> list[Answer]:
    facts = release(version)
    out = [
        Answer("stop at a token", 200,
               ok(facts, [10, 11, EOS], {"type": "stop", "matched": EOS}, retractions=2, cached=1),
               "FINISH_MATCHED_TOKEN (0.5.9 managers/schedule_batch.py:131; 0.5.23 managers/schedule_batch.py:284); "
               "output_ids run through the stop token (0.5.23 managers/schedule_batch.py:1512)",
               "generation", fields={"finish_reason": "stop", "matched_stop": EOS, "completion_tokens": 3,
                                     "retractions": 2, "cached_tokens": 1}),
        Answer("stop at a stop string", 200, ok(facts, [10, 11, 12], {"type": "stop", "matched": "\n\n"}),
               "FINISH_MATCHED_STR (0.5.9 managers/schedule_batch.py:143; 0.5.23 managers/schedule_batch.py:296)",
               "generation", fields={"finish_reason": "stop", "matched_stop": None}),
        Answer("length", 200, ok(facts, [10, 11, 12, 13], {"type": "length", "length": 4}),
               "FINISH_LENGTH (0.5.9 managers/schedule_batch.py:167; 0.5.23 managers/schedule_batch.py:320)",
               "generation", fields={"finish_reason": "length", "matched_stop": None, "completion_tokens": 4}),
        Answer("NaN happened", 200, ok(facts, [10, 11, EOS], {"type": "stop", "matched": "NaN happened"}),
               "_check_vocab_boundary_finish overwrites the bad token with EOS (0.5.9 "
               "managers/schedule_batch.py:1056-1070; 0.5.23 managers/schedule_batch.py:1989)",
               "sample", "nan_output"),
        Answer("abort without a status", 200, ok(facts, [10], abort(None, None)),
               "FINISH_ABORT() from /abort_request or a paused engine answers 200 (0.5.9 "
               "managers/tokenizer_manager.py:1153-1189; 0.5.23 managers/tokenizer_manager.py:1901-1906)",
               "sample", "retries_exhausted"),
        Answer("400: input too long for the scheduler", 400,
               value_error("Input length (40000 tokens) exceeds the maximum allowed length (32762 tokens). Use a "
                           "shorter input or enable --allow-auto-truncate."),
               "abort 400 -> ValueError (0.5.9 managers/utils.py:111, managers/tokenizer_manager.py:1157-1160; "
               "0.5.23 managers/utils.py:272, managers/tokenizer_manager.py:1917-1918)",
               "final", "server_rejected"),
        Answer("400: sampling value out of range", 400, value_error("top_p must be in (0, 1], got 0.0."),
               "SamplingParams.verify (0.5.23 sampling/sampling_params.py:260)", "final", "server_rejected"),
        Answer("400: request body not valid", 400,
               {"object": "error", "message": "1 validation error", "type": "Bad Request", "param": None,
                "code": 400},
               "RequestValidationError handler (0.5.9 entrypoints/http_server.py:409; 0.5.23 "
               "entrypoints/http_server.py:635)", "final", "server_rejected"),
        Answer("503: the queue is full", 503, error_response(503, "The request queue is full."),
               "abort 503 -> HTTPException (0.5.9 managers/scheduler.py:1736, managers/tokenizer_manager.py:"
               "1165-1185; 0.5.23 managers/scheduler.py:3562)", "overload", "retries_exhausted"),
        Answer("503: request running timeout", 503, error_response(503, "Request running timeout reached."),
               "0.5.9 managers/scheduler.py:1104", "overload", "retries_exhausted"),
        Answer("500: an abort with status 500", 500,
               error_response(500, "Out of memory even after retracting all other requests in the decode batch. "
                                   "Aborting the last request."),
               "0.5.23 managers/schedule_batch.py:3515-3518", "replica", "retries_exhausted"),
        Answer("401: wrong API key", 401, {"error": "Unauthorized"},
               "0.5.9 utils/auth.py:188-196; 0.5.23 utils/auth.py:196", "fatal", "unauthorized"),
    ]
    if facts.unknown_sampling_key_status == 500:
        out.append(Answer(
            "500: unknown sampling key (TypeError, plain text)", 500, "Internal Server Error",
            "SamplingParams(**kwargs) TypeError (0.5.9 managers/tokenizer_manager.py:911) is not caught (0.5.9 "
            "entrypoints/http_server.py:681; 0.5.21 entrypoints/http_server.py:958)", "replica", "retries_exhausted"))
    else:
        out.append(Answer(
            "400: unknown sampling key (contract gate, string error)", 400,
            {"error": "unknown field `max_tokens`, expected one of `max_new_tokens`, `stop`"},
            "0.5.22 entrypoints/http_server.py:921; 0.5.23 entrypoints/http_server.py:937-939",
            "final", "server_rejected"))
    if facts.abort_statuses_as_http == "400-599":
        out.append(Answer("429 from an abort", 429, error_response(429, "Too many requests"),
                          "any abort status in [400, 600) is raised (0.5.23 managers/tokenizer_manager.py:1905-1917)",
                          "overload", "retries_exhausted"))
    else:
        out.append(Answer("an abort with status 429 answers 200", 200, ok(facts, [], abort("Too many requests", 429)),
                          "only 400/500/503 become HTTP errors (0.5.9 managers/tokenizer_manager.py:1157-1185; 0.5.22 "
                          "managers/tokenizer_manager.py:1904)", "overload", "retries_exhausted"))
    if facts.eos_at_cap == "length":
        out.append(Answer(
            "NaN on the last allowed token finishes as length", 200,
            ok(facts, [10, 11, VOCAB + 1], {"type": "length", "length": 3}),
            "the length check returns before the vocabulary check (0.5.9 managers/schedule_batch.py:1081-1086)",
            "sample", "nan_output"))
    else:
        out.append(Answer(
            "EOS on the last allowed token is a stop", 200, ok(facts, [10, 11, EOS], {"type": "stop", "matched": EOS}),
            "stop before length (0.5.18 managers/schedule_batch.py:1626; 0.5.23 managers/schedule_batch.py:2034-2043)",
            "generation", fields={"finish_reason": "stop", "matched_stop": EOS}))
    return out


def legacy_answers() -> list[Answer]:
    """Releases before the supported range that a client may still meet."""
    facts = release("0.5.6")
    return [
        Answer("0.5.0-0.5.4.post2: prompt tokens prepended to output_ids", 200,
               {"text": "…", "output_ids": [5, 6, 7, 10, 11, EOS],
                "meta_info": meta(facts, {"type": "stop", "matched": EOS}, 3)},
               "output_ids from decode_ids = origin_input_ids[surr_offset:] + output_ids (PR #8837, fixed by "
               "#12628 in 0.5.4.post3; sgl-project/sglang#17240)", "final", "output_mismatch"),
        Answer("<= 0.4.10 text mode: no output_ids", 200,
               {"text": "…", "meta_info": meta(facts, {"type": "stop", "matched": EOS}, 3)},
               "output_ids only with --skip-tokenizer-init up to 0.4.10.post2 (reference/sglang.md §2.2)",
               "final", "bad_response"),
    ]


CASES = [(version, answer) for version in SUPPORTED_RELEASES for answer in answers(version)]
LEGACY = [("legacy", answer) for answer in legacy_answers()]


def case_id(case: tuple[str, Answer]) -> str:
    return f"{case[0]}: {case[1].name}"
