"""What an SGLang server's /server_info says, read the same way on every supported release. Pure.

The shape (0.5.9 entrypoints/http_server.py:593-610; 0.5.23 entrypoints/http_server.py:863): the ServerArgs fields
(until 0.5.18 as passed, so `context_length` and `max_running_requests` are None unless given; from 0.5.19 the
resolved values), the scheduler's `{status, max_total_num_tokens, max_req_input_len}` (0.5.9
managers/scheduler.py:3144; 0.5.23 managers/scheduler.py:1946), `internal_states` (one entry per data-parallel
scheduler, each with `effective_max_running_requests_per_dp` (0.5.9 managers/scheduler.py:2661; 0.5.23
managers/scheduler_components/internal_state.py:73) and `memory_usage.token_capacity`), and `version`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .releases import OLDEST_SUPPORTED, Release, UnknownReleaseError, release, version_key

logger = logging.getLogger(__name__)

# A server that reports neither its effective slots (releases before 0.5.8) nor a --max-running-requests: assume
# 256 running requests, a small server's number rather than SGLang's own default of 2048 or more.
FALLBACK_SLOTS = 256
# SGLang's scheduler keeps 5 tokens of headroom below max_req_len = min(context - 1, pool - 1)
# (0.5.9 managers/tp_worker.py:287-291; 0.5.23 managers/tp_worker.py:568-572): max_req_input_len = max_req_len - 5.
INPUT_HEADROOM = 5
# The last release whose text-mode output_ids carry up to 5 prompt tokens (sgl-project/sglang#17240, fixed in
# 0.5.4.post3 by #12628): a run on it would record every sample as output_mismatch.
LAST_PREPENDING_RELEASE = "0.5.4.post2"


class UnsupportedServer(ValueError):
    """A server whose answers tokenmill cannot use (a release that corrupts output_ids)."""


@dataclass(frozen=True)
class ServerFacts:
    url: str
    version: str | None  # the SGLang version it reports
    release: Release | None  # its facts, when tokenmill knows the release
    context_length: int | None  # only when it reports one
    max_total_num_tokens: int | None  # KV pool in tokens, per data-parallel scheduler
    max_req_len: int | None  # the longest prompt + output one request may reach: min(context - 1, pool - 1)
    page_size: int
    slots: int | None  # requests it runs at once, over its data-parallel schedulers
    kv_pools: tuple[int, ...]  # the KV pool of each data-parallel scheduler (each has its own), empty if unknown
    dp_groups: int = 1  # data-parallel schedulers (each with its own radix cache)

    @classmethod
    def read(cls, url: str, info: Mapping[str, Any]) -> ServerFacts:
        version = info.get("version") if isinstance(info.get("version"), str) else None
        states = [s for s in info.get("internal_states") or [] if isinstance(s, Mapping)]
        max_input = _positive(info.get("max_req_input_len"))
        pool = _positive(info.get("max_total_num_tokens"))
        # Data-parallel schedulers: --attn-dp-size (0.5.22+), --dp-size with or without --enable-dp-attention.
        groups = max(_positive(info.get("attn_dp_size")) or 1, _positive(info.get("dp_size")) or 1)
        return cls(
            url=url, version=version, release=_known_release(url, version),
            context_length=_positive(info.get("context_length")),
            max_total_num_tokens=pool,
            max_req_len=max_input + INPUT_HEADROOM if max_input else None,
            page_size=_positive(info.get("page_size")) or 1,
            slots=_slots(info, states, groups),
            kv_pools=_kv_pools(states, pool, groups),
            dp_groups=groups,
        )


def _positive(value: Any) -> int | None:
    return value if type(value) is int and value > 0 else None


def _slots(info: Mapping[str, Any], states: Sequence[Mapping[str, Any]], groups: int) -> int | None:
    # The effective value per data-parallel scheduler exists in every supported release (one internal state per
    # scheduler); a value passed on the command line is the fallback (under DP attention SGLang divides it over the
    # schedulers, so it is the total).
    effective = [_positive(s.get("effective_max_running_requests_per_dp")) for s in states]
    if effective and all(effective):
        return sum(effective) * (groups if len(effective) < groups else 1)  # type: ignore[arg-type]
    return _positive(info.get("max_running_requests"))


def _kv_pools(states: Sequence[Mapping[str, Any]], pool: int | None, groups: int) -> tuple[int, ...]:
    """Each data-parallel scheduler's pool: from its internal state, else the scheduler info's (the first
    scheduler's) for each of them."""
    capacities = [_positive((s.get("memory_usage") or {}).get("token_capacity")) for s in states]
    if capacities and all(capacities) and len(capacities) >= groups:
        return tuple(capacities)  # type: ignore[arg-type]
    first = capacities[0] if capacities and capacities[0] else pool
    return (first,) * groups if first else ()


def _known_release(url: str, version: str | None) -> Release | None:
    if version is None:
        logger.warning("%s reports no SGLang version; assuming the strictest request rules", url)
        return None
    try:
        key = version_key(version)
    except UnknownReleaseError:
        logger.warning("%s reports version %r, not an SGLang release; assuming the strictest request rules", url,
                       version)
        return None
    if key <= version_key(LAST_PREPENDING_RELEASE):
        raise UnsupportedServer(
            f"{url} runs SGLang {version}, whose /generate output_ids carry prompt tokens (releases up to "
            f"{LAST_PREPENDING_RELEASE}; older ones return no output_ids at all): run SGLang {OLDEST_SUPPORTED} "
            "or newer")
    try:
        facts = release(version)
    except UnknownReleaseError:
        logger.warning("%s runs SGLang %s, which tokenmill has no facts for; assuming the strictest request rules",
                       url, version)
        return None
    if not facts.supported:
        logger.warning("%s runs SGLang %s; tokenmill supports %s and newer", url, version, OLDEST_SUPPORTED)
    return facts


def runnable_requests(facts: Sequence[ServerFacts], replicas: int, typical_tokens: float) -> int:
    """Requests `replicas` servers run at once: per server its slots, or what its KV pool holds at a typical request
    length when that is fewer; the replicas that did not answer (down at the start) count like the average one."""
    if not facts:
        return FALLBACK_SLOTS * replicas
    per_server = []
    for server in facts:
        slots = server.slots or FALLBACK_SLOTS
        if server.kv_pools:
            slots = min(slots, sum(max(16, int(pool // typical_tokens)) for pool in server.kv_pools))
        per_server.append(slots)
    return int(sum(per_server) * replicas / len(facts))


def prompt_echo_accepted(facts: Sequence[ServerFacts]) -> bool:
    """Whether every server echoes the prompt ids it got when asked (`Release.echoes_prompt_ids`)."""
    return bool(facts) and all(f.release is not None and f.release.echoes_prompt_ids for f in facts)


def reasoning_counted(facts: Sequence[ServerFacts]) -> bool:
    """Whether every server reports meta_info.reasoning_tokens (`Release.has_reasoning_tokens`)."""
    return bool(facts) and all(f.release is not None and f.release.has_reasoning_tokens for f in facts)


def dp_ranks(facts: Sequence[ServerFacts]) -> dict[str, int]:
    """The data-parallel schedulers of each server whose release takes routed_dp_rank (one request's scheduler)."""
    return {f.url: f.dp_groups for f in facts if f.dp_groups > 1 and f.release is not None and f.release.routes_dp_rank}


def client_options(facts: Sequence[ServerFacts], reasoning_model: bool) -> dict[str, Any]:
    """What the /generate requests ask of these servers beyond ids and sampling (GenerateClient's keywords): the
    echo of the prompt ids, the data-parallel scheduler per request, SGLang's reasoning count (for a model that
    reasons)."""
    return {"echo_prompt_ids": prompt_echo_accepted(facts), "dp_ranks": dp_ranks(facts),
            "count_reasoning": reasoning_model and reasoning_counted(facts)}


def seeds_accepted(facts: Sequence[ServerFacts]) -> bool:
    """Whether every server takes `sampling_seed` in sampling_params (every supported release does: 0.5.9
    sampling/sampling_params.py:66, 0.5.23 sampling/sampling_params.py:179). A release tokenmill does not know is
    sent it too: sending an unknown key costs a 400 only from 0.5.22, which knows the key."""
    return all(f.release is None or "sampling_seed" in f.release.sampling_keys for f in facts)
