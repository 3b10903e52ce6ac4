"""What an SGLang server's /server_info says, read the same way on every supported release. Pure.

The shape (0.5.9 entrypoints/http_server.py:593-610; 0.5.23 entrypoints/http_server.py:863): the ServerArgs fields
(until 0.5.18 as passed, so `context_length` and `max_running_requests` are None unless given; from 0.5.19 the
resolved values), the scheduler's `{status, max_total_num_tokens, max_req_input_len}` (0.5.9
managers/scheduler.py:3144; 0.5.23 managers/scheduler.py:1946), `internal_states` (one entry per data-parallel
scheduler, each with `effective_max_running_requests_per_dp` (0.5.9 managers/scheduler.py:2661; 0.5.23
managers/scheduler_components/internal_state.py:73) and `memory_usage.token_capacity`), and `version`.

Where it is served: every supported release serves `/server_info` and its deprecated alias `/get_server_info` (0.5.9
entrypoints/http_server.py:583,593; 0.5.16 :733,743; 0.5.23 :853,863), likewise `/model_info` and
`/get_model_info`. SGLang's model gateway (smg 1.13, model_gateway/src/server.rs public_routes) serves only the
`get_` names, and answers them from its first worker (routers/http/router.rs proxy_get_request); its `GET /workers`
lists the workers with their labels (version, max_running_requests, ...), which no SGLang release serves.
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
# Tried in order: the current name first, then the name every release keeps as an alias and smg forwards.
SERVER_INFO_ROUTES = ("/server_info", "/get_server_info")
GATEWAY_WORKERS_ROUTE = "/workers"
# smg's /health is its own liveness (always 200, server.rs health -> liveness); /readiness answers 503 while no
# worker is healthy ("insufficient healthy workers"), so it is what says whether requests can go through.
GATEWAY_READINESS_ROUTE = "/readiness"


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
    workers: int = 0  # behind a gateway: the healthy workers its facts add up (0: the URL is a replica)
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

    def through_gateway(self, workers: Sequence[GatewayWorker]) -> ServerFacts:
        """A gateway's facts from its first worker's /get_server_info (these facts) and its worker list: capacity
        adds up over the healthy workers, each counted like the one that answered; the release is the workers' one
        release, or unknown (the strictest request rules) when they run different ones."""
        healthy = [worker for worker in workers if worker.healthy] or list(workers)
        count = max(1, len(healthy))
        versions = {worker.version for worker in healthy if worker.version}
        if self.version:
            versions.add(self.version)
        version, known = self.version, self.release
        if len(versions) > 1:
            logger.warning("%s: the gateway's workers run different SGLang releases (%s); assuming the strictest "
                           "request rules", self.url, ", ".join(sorted(versions)))
            version, known = None, None
        return ServerFacts(
            url=self.url, version=version, release=known, context_length=self.context_length,
            max_total_num_tokens=self.max_total_num_tokens, max_req_len=self.max_req_len, page_size=self.page_size,
            slots=self.slots * count if self.slots else None, kv_pools=self.kv_pools * count, workers=count,
            dp_groups=self.dp_groups)


@dataclass(frozen=True)
class GatewayWorker:
    """One worker in smg's GET /workers answer (protocols/src/worker.rs: url, is_healthy, labels as strings)."""

    url: str
    healthy: bool
    version: str | None


def gateway_workers(body: Any) -> list[GatewayWorker] | None:
    """The workers of an smg gateway from its /workers answer ({"workers": [...], "total": n}); None when the body
    is not that (an SGLang replica has no /workers route and answers 404)."""
    if not isinstance(body, Mapping) or not isinstance(body.get("workers"), list):
        return None
    workers = []
    for entry in body["workers"]:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("url"), str):
            continue
        labels = entry.get("labels")
        version = labels.get("version") if isinstance(labels, Mapping) else None
        workers.append(GatewayWorker(url=entry["url"], healthy=entry.get("is_healthy") is True,
                                     version=version if isinstance(version, str) and version else None))
    return workers


class FactsUnreadable(RuntimeError):
    """No route of a --server URL answered its facts: the URL is not an SGLang server or a gateway in front of one,
    or it answers with an error that waiting did not end."""


def unreadable_message(url: str, tried: Sequence[tuple[str, str]]) -> str:
    """What was tried on `url` and what each answered, and what to do about it."""
    attempts = "; ".join(f"GET {url.rstrip('/')}{path}: {answer}" for path, answer in tried)
    answers = [answer for _, answer in tried]
    if any(answer.startswith(("HTTP 401", "HTTP 403")) for answer in answers):
        hint = "the server wants an API key: set the runner's API key secret (TOKENMILL_API_KEY) to the server's"
    elif any(answer.startswith("HTTP 503") for answer in answers):
        hint = ("the server stayed unavailable (an smg gateway with no healthy worker, or SGLang still loading): "
                "check that its workers are up and registered (GET /workers on the gateway), or wait longer with "
                "--server-wait")
    else:
        hint = ("point --server at an SGLang server (0.5.9 or newer, `python -m sglang.launch_server`) or at an smg "
                "gateway in front of SGLang replicas (`smg launch --worker-urls ...`): both answer one of "
                f"{', '.join(SERVER_INFO_ROUTES)} with the server's facts as JSON")
    return f"cannot read the server's facts from {url}: {attempts}. {hint}"


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
