"""SGLang's native /generate (over `transport.py`'s keep-alive connections): ids in, ids out, across replicas that
come and go.

Each request goes to a live replica: the one that holds its prefix when it belongs to a group (the samples of one
prompt, the turns of one conversation) and that replica is not loaded past a bounded imbalance (`routing.py`), else
the one with the fewest requests outstanding from this client (ties rotate); inside a replica with several
data-parallel schedulers, a group goes to one of them (`routed_dp_rank`). Where the release echoes the prompt ids
(`return_prompt_token_ids`), they are asked for and compared with the ids sent (`results.py`). A replica
that fails is taken out and probed on /health until it answers (`replica_health.py`); a retry goes to another live
replica when there is one. While no replica is live, requests wait without spending any sample's attempts; when
that lasts longer than the outage budget, `generate` raises `ServersUnavailable` and nothing is written off. A
sample's attempts are spent only by failures that are plausibly its own (`results.py` says which).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from array import array
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import httpx
import numpy as np
import orjson

from .replica_health import HealthPolicy, ReplicaSet, Suspect
from .results import (
    AttemptFailed,
    Fault,
    Generation,
    GenerationFailure,
    ServersUnavailable,
    classify_error,
    parse_generation,
    transport_failure,
)
from .routing import PrefixAffinity, dp_rank, prefix_hashes
from .transport import AnswerTooLarge, PostPool, TransportError

logger = logging.getLogger(__name__)

HEALTH_TICK_S = 1.0  # how often the outage gauge is refreshed while a replica is down


class ServerFatalError(RuntimeError):
    """A server answer that no retry or other sample can fix (wrong API key, wrong URL): stop the run."""


Answer = TypeVar("Answer")


class HealthListener(Protocol):
    """Where replica health goes (the runner's metrics)."""

    def replica_state(self, url: str, live: bool) -> None: ...

    def outage(self, seconds: float) -> None: ...


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 6  # failures plausibly the sample's own before it is recorded
    # A prompt that crashes the server (a scheduler assertion, a CUDA fault on one input) would otherwise be resent
    # forever, each time taking the replica and everything in flight on it down. A sample whose request was in
    # flight during `quarantine_after` replica deaths is a suspect: its next attempts run in quarantine, one
    # suspect at a time across the client (other traffic goes on), so a death during its turn points at it (there a
    # dropped connection counts as a death). It is given up as `replica_crash` (retryable: --retry-failed runs it
    # again) after `max_replica_deaths` deaths in quarantine, or `max_deaths_in_flight` deaths in all.
    quarantine_after: int = 2
    max_replica_deaths: int = 2
    max_deaths_in_flight: int = 8
    base_delay_s: float = 0.5
    max_delay_s: float = 30.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        # Full jitter: spreads retries of many requests that failed together (a server restart) over time.
        return rng.uniform(0, min(self.max_delay_s, self.base_delay_s * 2 ** (min(attempt, 30) - 1)))


_NO_LOCK = contextlib.nullcontext()


class PromptIds:
    """A prompt's ids as the requests of all its samples (and their retries) send them: 4 bytes an id, and their JSON
    encoded once, by the first request that needs it."""

    __slots__ = ("ids", "_json", "_names")

    def __init__(self, ids: array[int]) -> None:
        self.ids = ids
        self._json: bytes | None = None
        self._names: list[int] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def json(self) -> bytes:
        if self._json is None:
            self._json = orjson.dumps(np.frombuffer(self.ids, dtype=np.int32), option=orjson.OPT_SERIALIZE_NUMPY)
        return self._json

    def prefix_names(self) -> list[int]:
        """Its leading blocks' names for prefix routing (`routing.prefix_hashes`), made once."""
        if self._names is None:
            self._names = prefix_hashes(np.frombuffer(self.ids, dtype=np.int32))
        return self._names


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class GenerateClient:
    def __init__(self, servers: Sequence[str], *, api_key: str | None = None, concurrency: int = 64,
                 retry: RetryPolicy | None = None, health: HealthPolicy | None = None, timeout_s: float = 3600.0,
                 seed: int | None = None, listener: HealthListener | None = None,
                 initially_down: Sequence[str] = (), vocab_size: int | None = None,
                 probe_routes: Mapping[str, str] | None = None, affinity: PrefixAffinity | None = None,
                 prefix_affine: bool = True, echo_prompt_ids: bool = False, dp_ranks: Mapping[str, int] | None = None,
                 count_reasoning: bool = False) -> None:
        """`prefix_affine=False` routes every request to the least-loaded replica (the benchmark's baseline);
        `echo_prompt_ids` asks every answer for the ids the server saw (only where every server's release echoes
        them); `dp_ranks` is each server's data-parallel schedulers where its release takes routed_dp_rank;
        `count_reasoning` sets require_reasoning, so SGLang counts the reasoning tokens it saw (meta_info
        reasoning_tokens; with no constrained decoding it changes nothing else)."""
        if not servers:
            raise ValueError("at least one server URL is needed")
        self.servers = [url.rstrip("/") for url in servers]
        self.health = health or HealthPolicy()
        self.replicas = ReplicaSet(self.servers, self.health, frozenset(u.rstrip("/") for u in initially_down))
        # A replica is probed on /health; a gateway on the route that says whether a worker is behind it.
        self._probe_routes = {url.rstrip("/"): route for url, route in (probe_routes or {}).items()}
        self.outstanding = dict.fromkeys(self.servers, 0)
        self.retry = retry or RetryPolicy()
        self.retries = 0  # requests beyond the first of each sample, over the whole run
        self._quarantine = asyncio.Lock()  # one suspect of crashing replicas in flight at a time
        self.listener = listener
        self.vocab_size = vocab_size
        self.affinity = (affinity or PrefixAffinity()) if prefix_affine else None
        self.echo_prompt_ids = echo_prompt_ids
        self.count_reasoning = count_reasoning
        self._unechoed: set[str] = set()
        self.dp_ranks = {url.rstrip("/"): n for url, n in (dp_ranks or {}).items() if n > 1}
        self._rng = random.Random(seed)
        self._headers = {"Content-Type": "application/json", **auth_headers(api_key)}
        self._http = PostPool(self._headers, timeout_s)  # /generate; probes use a short-lived httpx client
        self._changed: asyncio.Event | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._probes: set[asyncio.Task[None]] = set()
        for url in self.servers:
            self._tell_state(url)

    async def aclose(self) -> None:
        tasks = [t for t in (self._watcher, *self._probes) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._http.aclose()

    # -- one sample ----------------------------------------------------------------------------------------
    async def generate(self, input_ids: list[int] | PromptIds, sampling_params: dict[str, Any],
                       seed_for: Callable[[int], int] | None = None,
                       affinity: Hashable | None = None) -> Generation | GenerationFailure:
        """The sample's generation, or its final failure. `seed_for(n)` is the sampling_seed of the n-th attempt
        (from 0), so a retry does not replay the draw that failed; requests with the same `affinity` key share a
        prefix and go where it is cached. Raises ServersUnavailable past the outage budget and ServerFatalError on
        a wrong key or URL."""
        prompt = input_ids if isinstance(input_ids, PromptIds) else PromptIds(array("i", input_ids))

        def body(attempt: int, server: str) -> bytes:
            seed = None if seed_for is None else seed_for(attempt)
            return self.encode_body(server, prompt, sampling_params, seed, affinity)

        async def read(server: str, content: bytes, attempt: int) -> Generation | AttemptFailed:
            return self._generation(server, content, attempt, prompt if self.echo_prompt_ids else None)

        return await self.send(body, read, affinity, prompt=prompt)

    async def send(self, body: Callable[[int, str], bytes],
                   read: Callable[[str, bytes, int], Awaitable[Answer | AttemptFailed]],
                   affinity: Hashable | None = None, limit_bytes: int | None = None,
                   prompt: PromptIds | None = None) -> Answer | GenerationFailure:
        """Any /generate request under the client's rules (a live replica, retries, quarantine, the outage wait):
        `body(attempt, server)` is the n-th attempt's body (from 0), `read(server, content, attempt)` turns an HTTP
        200 answer into the result or an AttemptFailed that says whose fault it is; an answer longer than
        `limit_bytes` is refused unread (FINAL). The result, or the request's final failure; raises
        ServersUnavailable past the outage budget and ServerFatalError on a wrong key or URL. The stream's samples
        and the hidden-state captures (hidden_capture.py) both go through here."""
        sent = own_failures = 0
        suspects: list[Suspect] = []  # server-side failures, judged by what the replica did next
        quarantined: list[Suspect] = []  # those of attempts made in quarantine
        previous: str | None = None
        while True:
            suspect = bool(suspects) and self.replicas.deaths(suspects) >= self.retry.quarantine_after
            async with self._quarantine if suspect else _NO_LOCK:
                server = self._pick(previous, affinity, prompt) or await self._acquire(previous, affinity, prompt)
                sent += 1
                self.retries += sent > 1
                self.outstanding[server] += 1
                try:
                    outcome = await self._attempt(server, body(sent - 1, server), sent, read, limit_bytes)
                finally:
                    self.outstanding[server] -= 1
                if not isinstance(outcome, AttemptFailed):
                    self.replicas.record_success(server)
                    return outcome
                if outcome.fault is Fault.FINAL:
                    return GenerationFailure(outcome.reason, outcome.message, sent)
                if outcome.fault is Fault.SAMPLE:
                    own_failures += 1
                else:
                    if outcome.fault is not Fault.OVERLOAD:  # judged by what the replica does next, this one included
                        suspects.append(self.replicas.suspect(server, dropped=outcome.dropped))
                        if suspect:
                            quarantined.append(suspects[-1])
                    self._replica_failed(server, outcome)
            given_up = self._given_up(outcome, sent, own_failures, suspects, quarantined)
            if given_up is not None:
                return given_up
            logger.debug("attempt %d failed (%s): %s", sent, outcome.fault.value, outcome.message)
            previous = server
            await asyncio.sleep(self.retry.delay(sent, self._rng))

    def request_body(self, server: str, input_ids: list[int], sampling_params: dict[str, Any],
                     seed: int | None = None, affinity: Hashable | None = None) -> dict[str, Any]:
        """The /generate body of one attempt on `server` (tests/contract checks it against each release's schema)."""
        return {"input_ids": input_ids, **self._request_fields(server, sampling_params, seed, affinity)}

    def encode_body(self, server: str, prompt: PromptIds, sampling_params: dict[str, Any], seed: int | None = None,
                    affinity: Hashable | None = None) -> bytes:
        """`request_body` as JSON, the prompt's ids spliced in as the prompt encoded them once for all its samples
        and attempts (byte for byte what orjson writes for the whole body)."""
        fields = orjson.dumps(self._request_fields(server, sampling_params, seed, affinity))
        return b'{"input_ids":' + prompt.json() + b"," + fields[1:]

    def _request_fields(self, server: str, sampling_params: dict[str, Any], seed: int | None,
                        affinity: Hashable | None) -> dict[str, Any]:
        params = sampling_params if seed is None else {**sampling_params, "sampling_seed": seed}
        request: dict[str, Any] = {"sampling_params": params}
        if self.echo_prompt_ids:
            request["return_prompt_token_ids"] = True
        if self.count_reasoning:
            request["require_reasoning"] = True
        ranks = self.dp_ranks.get(server, 1)
        if ranks > 1 and affinity is not None:
            request["routed_dp_rank"] = dp_rank(affinity, ranks)
        return request

    def _given_up(self, outcome: AttemptFailed, sent: int, own_failures: int, suspects: list[Suspect],
                  quarantined: list[Suspect]) -> GenerationFailure | None:
        """The sample's final failure once its failures are charged enough, else None (it is tried again)."""
        charged = own_failures + self.replicas.charged(suspects)
        if charged >= self.retry.max_attempts:
            return GenerationFailure(outcome.reason, f"gave up after {charged} failed attempts ({sent} requests); "
                                     f"last error: {outcome.message}", sent)
        # In quarantine a dropped connection is the death itself: a replica restarted quickly may never be seen down.
        alone, deaths = sum(s.dropped for s in quarantined), self.replicas.deaths(suspects)
        if alone >= self.retry.max_replica_deaths or deaths >= self.retry.max_deaths_in_flight:
            return GenerationFailure(
                "replica_crash", f"the replica went down {deaths} times with this request in flight ({alone} of "
                f"them while it was the only suspect in flight; {sent} requests): the prompt may crash the server; "
                f"last error: {outcome.message}", sent)
        return None

    def _replica_failed(self, server: str, failed: AttemptFailed) -> None:
        """Report a server-side failure to the replica's breaker."""
        if failed.fault is Fault.FATAL:
            raise ServerFatalError(failed.message)
        loop = asyncio.get_running_loop()
        opened = self.replicas.record_failure(server, loop.time(), failed.message,
                                              failed.fault is Fault.UNREACHABLE, self._rng.random())
        if opened:
            logger.warning("taking %s out of rotation: %s", server, failed.message)
            self._tell_state(server)
            self._notify()  # the watcher schedules its first probe

    def _pick(self, avoid: str | None, affinity: Hashable | None, prompt: PromptIds | None = None) -> str | None:
        """A live replica for the next attempt, None when none is (without an await: this runs per request)."""
        if self._watcher is None or self._watcher.done():
            return None  # _acquire starts it
        candidates = self.replicas.candidates(avoid)
        return self._choose(candidates, affinity, prompt) if candidates else None

    async def _acquire(self, avoid: str | None, affinity: Hashable | None = None,
                       prompt: PromptIds | None = None) -> str:
        """A live replica for the next attempt; waits (spending no attempt) while none is."""
        loop = asyncio.get_running_loop()
        self._ensure_watcher()
        while True:
            candidates = self.replicas.candidates(avoid)
            if candidates:
                return self._choose(candidates, affinity, prompt)
            now = loop.time()
            self.replicas.note_time(now)
            if self.replicas.outage_exceeded(now):
                raise ServersUnavailable(
                    f"no SGLang server was live for {self.replicas.outage_seconds(now):.0f} s, more than the outage "
                    f"budget of {self.health.outage_budget_s:.0f} s (spec.runner.outageBudgetSeconds): "
                    f"{self.replicas.describe()}")
            remaining = self.health.outage_budget_s - self.replicas.outage_seconds(now)
            await _wait(self._event(), max(0.01, remaining + 0.01))

    def _choose(self, candidates: list[str], affinity: Hashable | None, prompt: PromptIds | None = None) -> str:
        def least_loaded(among: Sequence[str]) -> str:
            return self.replicas.least_loaded(among, self.outstanding)

        if self.affinity is None or affinity is None or len(self.servers) == 1:
            return least_loaded(candidates)
        return self.affinity.choose(affinity, candidates, self.outstanding, self.replicas.epochs(), least_loaded,
                                    None if prompt is None else prompt.prefix_names)

    # -- one HTTP request ----------------------------------------------------------------------------------
    async def _attempt(self, server: str, body: bytes, attempt: int,
                       read: Callable[[str, bytes, int], Awaitable[Answer | AttemptFailed]],
                       limit_bytes: int | None = None) -> Answer | AttemptFailed:
        try:
            answer = await self._http.post(f"{server}/generate", body, limit_bytes)
        except TransportError as error:
            return transport_failure(server, type(error).__name__, str(error), connect=error.connect)
        except AnswerTooLarge as error:
            return AttemptFailed(Fault.FINAL, "bad_response", f"{server}: {error}, more than the request can take")
        if answer.status != 200:
            return classify_error(answer.status, answer.content, server)
        return await read(server, answer.content, attempt)

    def _generation(self, server: str, content: bytes, attempt: int,
                    prompt: PromptIds | None) -> Generation | AttemptFailed:
        try:
            payload = orjson.loads(content)
        except orjson.JSONDecodeError:
            return AttemptFailed(Fault.SAMPLE, "bad_response",
                                 f"{server}: /generate answered 200 with a body that is not JSON")
        if self.echo_prompt_ids and isinstance(payload, dict) and "prompt_token_ids" not in payload:
            if server not in self._unechoed:
                self._unechoed.add(server)
                logger.warning("%s answers without prompt_token_ids although they were asked for: the ids it "
                               "generated from cannot be checked (an SGLang release before 0.5.13.post1?)", server)
        return parse_generation(payload, server, attempt, self.vocab_size,
                                None if prompt is None else prompt.ids.tolist())

    # -- health --------------------------------------------------------------------------------------------
    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _notify(self) -> None:
        event = self._event()
        self._changed = asyncio.Event()
        event.set()

    def _ensure_watcher(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch(), name="tokenmill-replica-health")

    async def _watch(self) -> None:
        """Probe the replicas that are down when their probes are due; refresh the outage gauge."""
        loop = asyncio.get_running_loop()
        probing: set[str] = set()
        while True:
            now = loop.time()
            for url in self.replicas.due_probes(now):
                if url not in probing:
                    probing.add(url)
                    task = loop.create_task(self._probe(url, probing))
                    self._probes.add(task)
                    task.add_done_callback(self._probes.discard)
            if self.listener is not None:
                self.listener.outage(self.replicas.outage_seconds(now))
            wake_at = self.replicas.next_probe_at(exclude=probing)
            delay = HEALTH_TICK_S if wake_at is None else min(HEALTH_TICK_S, max(0.0, wake_at - now))
            await _wait(self._event(), max(0.005, delay))

    async def _probe(self, url: str, probing: set[str]) -> None:
        try:
            healthy, message = await self._health(url)
            now = asyncio.get_running_loop().time()
            if self.replicas.record_probe(url, now, healthy, message, self._rng.random()):
                logger.warning("%s answers %s again: back in rotation", url, self._probe_route(url))
                self._tell_state(url)
                self._notify()
        finally:
            probing.discard(url)

    def _probe_route(self, url: str) -> str:
        return self._probe_routes.get(url, "/health")

    async def _health(self, url: str) -> tuple[bool, str]:
        route = self._probe_route(url)
        try:
            async with httpx.AsyncClient(timeout=self.health.probe_timeout_s, headers=self._headers) as http:
                response = await http.get(f"{url}{route}")
        except httpx.HTTPError as error:
            return False, f"{route}: {type(error).__name__}"
        return response.status_code == 200, f"{route}: HTTP {response.status_code}"

    def _tell_state(self, url: str) -> None:
        if self.listener is not None:
            self.listener.replica_state(url, url in self.replicas.live())


async def _wait(event: asyncio.Event, timeout_s: float) -> None:
    """Until the event is set or the timeout passes. asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow
    a cancellation that arrives as the event is set, and a task that ignores its cancellation never stops."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await event.wait()


async def healthy_servers(urls: Sequence[str], timeout_s: float, api_key: str | None = None,
                          poll_s: float = 2.0) -> list[str]:
    """Poll /health of every server until at least one answers 200 (SGLang answers 503 until its warm-up
    generation is done); the ones answering 200 in that round. The others join the run when they come up."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last: dict[str, str] = dict.fromkeys(urls, "no answer yet")
    async with httpx.AsyncClient(timeout=30.0, headers=auth_headers(api_key)) as http:
        while True:
            answers = await asyncio.gather(*(_health_once(http, url) for url in urls))
            last = {url: answer for url, answer in zip(urls, answers, strict=True)}
            healthy = [url for url, answer in last.items() if answer == "200"]
            if healthy:
                for url, answer in last.items():
                    if answer != "200":
                        logger.warning("%s is not healthy yet (%s); starting without it", url, answer)
                return healthy
            if loop.time() >= deadline:
                break
            logger.info("waiting for a healthy server: %s", "; ".join(f"{u}: {a}" for u, a in last.items()))
            await asyncio.sleep(poll_s)
    detail = "; ".join(f"{url}: {answer}" for url, answer in last.items())
    raise ServersUnavailable(f"no server became healthy within {timeout_s:.0f}s (--server-wait) ({detail}); check "
                             "that the server is up and its URL, then run again")


async def _health_once(http: httpx.AsyncClient, url: str) -> str:
    try:
        response = await http.get(f"{url.rstrip('/')}/health")
    except httpx.TransportError as error:
        return type(error).__name__
    return "200" if response.status_code == 200 else f"HTTP {response.status_code}"


async def wait_until_healthy(url: str, timeout_s: float, api_key: str | None = None, poll_s: float = 2.0) -> None:
    """Poll one server's /health until it answers 200 (prepare uses healthy_servers: a run starts with the first)."""
    await healthy_servers([url], timeout_s, api_key, poll_s)
