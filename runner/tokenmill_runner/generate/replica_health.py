"""Which SGLang replicas are live: a circuit breaker per replica, and the outage clock. Pure: the caller passes the
time and the random numbers, so every transition is tested without servers or sleeps.

A replica is `live` until it fails: at once when nothing answers at its address (connection refused), or after
`open_after` server-side failures in a row with no success between (HTTP 5xx, 503/429, dropped connections). Then it
is `down`: no request goes to it, and `/health` is probed with a growing, jittered interval; SGLang answers 503 there
while it loads weights and warms up, and 200 once a one-token generation went through, so a 200 makes it live again.
A replica that goes down again before it answered any request waits longer for its first probe each time
(flapping). While no replica is live, the outage clock runs; only a successful generation stops it (a replica
that answers /health but fails every request is still an outage).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

# SGLang's /health runs a one-token generation and answers 503 after SGLANG_HEALTH_CHECK_TIMEOUT, 20 s by default
# (0.5.9 entrypoints/http_server.py:166; 0.5.23 entrypoints/http_server.py:218): a probe must wait longer than that.
SGLANG_HEALTH_CHECK_TIMEOUT_S = 20.0


class State(enum.Enum):
    LIVE = "live"
    DOWN = "down"


@dataclass(frozen=True)
class HealthPolicy:
    open_after: int = 5  # server-side failures in a row that take a replica out
    probe_first_s: float = 1.0  # first /health probe after a replica is taken out
    probe_max_s: float = 30.0  # the probe interval doubles up to this
    probe_timeout_s: float = SGLANG_HEALTH_CHECK_TIMEOUT_S + 10.0
    outage_budget_s: float = 7200.0  # spec.runner.outageBudgetSeconds

    def __post_init__(self) -> None:
        if self.open_after < 1:
            raise ValueError("open_after must be at least 1")
        if not 0 < self.probe_first_s <= self.probe_max_s:
            raise ValueError("need 0 < probe_first_s <= probe_max_s")
        if self.probe_timeout_s <= 0 or self.outage_budget_s <= 0:
            raise ValueError("probe_timeout_s and outage_budget_s must be positive")


@dataclass
class ReplicaBreaker:
    url: str
    policy: HealthPolicy
    state: State = State.LIVE
    failures_in_row: int = 0
    successes: int = 0  # generations answered, over the client's life
    outages: int = 0  # times it was taken out
    openings_without_success: int = 0
    probe_delay: float = 0.0
    next_probe_at: float = 0.0
    last_error: str = ""

    def record_success(self) -> None:
        self.successes += 1
        self.failures_in_row = 0
        self.openings_without_success = 0

    def record_failure(self, now: float, message: str, unreachable: bool, jitter: float) -> bool:
        """A server-side failure; True when it took the replica out just now. `jitter` in [0, 1)."""
        self.last_error = message
        if self.state is State.DOWN:
            return False
        self.failures_in_row += 1
        if unreachable or self.failures_in_row >= self.policy.open_after:
            self._open(now, jitter)
            return True
        return False

    def start_down(self) -> None:
        """Not healthy when the run starts: out of rotation, probed at once."""
        self.state = State.DOWN
        self.probe_delay = self.policy.probe_first_s
        self.next_probe_at = float("-inf")

    def _open(self, now: float, jitter: float) -> None:
        self.state = State.DOWN
        self.outages += 1
        self.openings_without_success += 1
        first = self.policy.probe_first_s * 2 ** (self.openings_without_success - 1)
        self.probe_delay = min(self.policy.probe_max_s, first)
        self.next_probe_at = now + self._jittered(self.probe_delay, jitter)

    def _jittered(self, delay: float, jitter: float) -> float:
        # Between half and all of the delay: many runner workers probing one replica spread out.
        return delay * (0.5 + 0.5 * jitter)

    def probe_due(self, now: float) -> bool:
        return self.state is State.DOWN and now >= self.next_probe_at

    def record_probe(self, now: float, healthy: bool, message: str, jitter: float) -> bool:
        """The answer of a /health probe; True when the replica is live again."""
        if self.state is State.LIVE:
            return False
        if healthy:
            self.state = State.LIVE
            self.failures_in_row = 0
            return True
        self.last_error = message
        self.probe_delay = min(self.policy.probe_max_s, self.probe_delay * 2)
        self.next_probe_at = now + self._jittered(self.probe_delay, jitter)
        return False


@dataclass(frozen=True)
class Suspect:
    """A server-side failure of one sample's request, judged later: it counts against the sample only if the
    replica then answered other requests without going down in between (so it was working, and the failure was
    plausibly the sample's own, e.g. an abort of that request alone). A replica that died never counts."""

    url: str
    successes: int
    outages: int
    dropped: bool = False  # the request reached the replica and its connection was dropped (not refused)
    down: bool = False  # the replica was already taken out when this failure came in (others failed first)

    def charged(self, breaker: ReplicaBreaker) -> bool:
        return breaker.outages == self.outages and breaker.successes > self.successes

    def died(self, breaker: ReplicaBreaker) -> bool:
        """The replica died with this request in flight: it was sent to a live replica, its connection dropped, and
        the replica was down by then or went down after."""
        return self.dropped and (self.down or breaker.outages > self.outages)


@dataclass
class ReplicaSet:
    """The breakers of all replicas, the choice of a replica per request, and the outage clock."""

    urls: Sequence[str]
    policy: HealthPolicy = field(default_factory=HealthPolicy)
    initially_down: frozenset[str] = frozenset()
    outage_started: float | None = None
    _turn: int = 0
    _epochs: dict[str, int] | None = field(default=None, init=False, repr=False)
    _epochs_at: int = field(default=-1, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("at least one server URL is needed")
        self.breakers = {url: ReplicaBreaker(url, self.policy) for url in self.urls}
        for url in self.initially_down:
            self.breakers[url].start_down()

    def live(self) -> list[str]:
        return [url for url in self.urls if self.breakers[url].state is State.LIVE]

    def pick(self, outstanding: Mapping[str, int], avoid: str | None = None) -> str | None:
        """The live replica with the fewest requests outstanding (ties rotate), not `avoid` when another is live;
        None when no replica is live."""
        candidates = self.candidates(avoid)
        return self.least_loaded(candidates, outstanding) if candidates else None

    def candidates(self, avoid: str | None = None) -> list[str]:
        """The live replicas, without `avoid` when another is live."""
        return [url for url in self.live() if url != avoid] or self.live()

    def least_loaded(self, candidates: Sequence[str], outstanding: Mapping[str, int]) -> str:
        least = min(outstanding.get(url, 0) for url in candidates)
        tied = [url for url in candidates if outstanding.get(url, 0) == least]
        self._turn += 1
        return tied[self._turn % len(tied)]

    def epochs(self) -> dict[str, int]:
        """Each replica's outage count: a replica that went down since lost what it cached. Asked per request, so
        made again only when an outage count changed (the caller must not change it)."""
        outages = sum(breaker.outages for breaker in self.breakers.values())
        if self._epochs is None or self._epochs_at != outages:
            self._epochs = {url: breaker.outages for url, breaker in self.breakers.items()}
            self._epochs_at = outages
        return self._epochs

    def record_success(self, url: str) -> None:
        self.breakers[url].record_success()
        self.outage_started = None

    def record_failure(self, url: str, now: float, message: str, unreachable: bool, jitter: float) -> bool:
        opened = self.breakers[url].record_failure(now, message, unreachable, jitter)
        self.note_time(now)
        return opened

    def record_probe(self, url: str, now: float, healthy: bool, message: str, jitter: float) -> bool:
        return self.breakers[url].record_probe(now, healthy, message, jitter)

    def suspect(self, url: str, dropped: bool = False) -> Suspect:
        breaker = self.breakers[url]
        return Suspect(url, breaker.successes, breaker.outages, dropped, breaker.state is State.DOWN)

    def charged(self, suspects: Sequence[Suspect]) -> int:
        return sum(1 for suspect in suspects if suspect.charged(self.breakers[suspect.url]))

    def deaths(self, suspects: Sequence[Suspect]) -> int:
        """Replica deaths this sample's requests were in flight for."""
        return sum(1 for suspect in suspects if suspect.died(self.breakers[suspect.url]))

    def note_time(self, now: float) -> None:
        """Start the outage clock when no replica is live (it stops at the next successful generation)."""
        if self.outage_started is None and not self.live():
            self.outage_started = now

    def outage_seconds(self, now: float) -> float:
        return 0.0 if self.outage_started is None else max(0.0, now - self.outage_started)

    def outage_exceeded(self, now: float) -> bool:
        return self.outage_seconds(now) > self.policy.outage_budget_s

    def due_probes(self, now: float) -> list[str]:
        return [url for url in self.urls if self.breakers[url].probe_due(now)]

    def next_probe_at(self, exclude: Collection[str] = ()) -> float | None:
        """When the next probe is due, leaving out replicas whose probe is under way."""
        times = [b.next_probe_at for url, b in self.breakers.items() if b.state is State.DOWN and url not in exclude]
        return min(times) if times else None

    def describe(self) -> str:
        """Each replica's state and last error, for messages."""
        parts = []
        for url in self.urls:
            breaker = self.breakers[url]
            detail = f" ({breaker.last_error})" if breaker.last_error else ""
            parts.append(f"{url}: {breaker.state.value}{detail}")
        return "; ".join(parts)
