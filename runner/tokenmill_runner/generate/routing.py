"""Prefix-affine replica choice: the requests that share a prefix go where it is cached, within a bounded imbalance.

SGLang keeps every prompt it prefilled in its radix cache, per replica (and per data-parallel scheduler). The samples
of one prompt (`samples: n`) and the turns of one conversation (`mode: all-turns`, each turn's prompt extends the
last) share their prompt's tokens, so the first request of such a group pays the prefill and the others find it
cached, but only on the replica that served the first. With least-loaded routing over R replicas the others land
there about 1/R of the time. Here a group (its *affinity key*) remembers the replicas that served it, and its next
request goes to the least loaded of them, unless that one is past the spill gate; then to the least-loaded live
replica, which joins the group's holders.

The spill gate is smg's cache-aware one (smg 1.13.0 `smg/router_args.py:90-91` the defaults, `:688-713` the rule in
the help of --balance-abs-threshold and --balance-rel-threshold): a holder is skipped when its load exceeds the live fleet's mean by the absolute margin AND exceeds the relative
threshold times the mean; the absolute margin is capped at the in-flight count's natural swing at that mean (two
standard deviations, never under four unless the threshold itself is lower), so a small pool can spill at all.
The load is the requests this client has outstanding on a replica (each runner worker balances its own traffic).

A replica that is down is no candidate, so its groups move; a replica that went down and came back lost its
cache, so holders are remembered with the replica's outage count (its *epoch*) and forgotten when it changed.
Pure: the caller passes the live replicas, their loads and epochs, and the least-loaded rule.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

# smg's --balance-abs-threshold and --balance-rel-threshold defaults (smg 1.13.0 smg/router_args.py:90-91).
SPILL_ABS_THRESHOLD = 64
SPILL_REL_THRESHOLD = 1.5
MIN_SWING = 4.0  # "never under four unless this value is lower" (smg 1.13.0 smg/router_args.py:696-698)
# Groups remembered at once. A group is done when its last sample or turn is (the pipeline hands a prompt's samples
# out together), so this only has to outlast the requests in flight; the oldest group is forgotten first.
MAX_GROUPS = 65_536
MAX_HOLDERS = 8  # replicas remembered per group


@dataclass(frozen=True)
class SpillGate:
    abs_threshold: int = SPILL_ABS_THRESHOLD
    rel_threshold: float = SPILL_REL_THRESHOLD

    def __post_init__(self) -> None:
        if self.abs_threshold < 0:
            raise ValueError("abs_threshold must be at least 0")
        if not math.isfinite(self.rel_threshold) or self.rel_threshold < 1.0:
            raise ValueError("rel_threshold must be finite and at least 1.0 (as smg requires)")

    def margin(self, mean: float) -> float:
        """The absolute margin over the mean: the threshold, capped at two standard deviations of a Poisson
        in-flight count at that mean (2 * sqrt(mean)), but at least MIN_SWING unless the threshold is lower."""
        return min(float(self.abs_threshold), max(MIN_SWING, 2.0 * math.sqrt(max(mean, 0.0))))

    def overloaded(self, load: int, mean: float) -> bool:
        return load > mean + self.margin(mean) and load > self.rel_threshold * mean


class PrefixAffinity:
    """The replicas that hold each group's prefix, and the choice of a replica for a group's next request."""

    def __init__(self, gate: SpillGate | None = None, max_groups: int = MAX_GROUPS) -> None:
        if max_groups < 1:
            raise ValueError("max_groups must be at least 1")
        self.gate = gate or SpillGate()
        self.max_groups = max_groups
        self._holders: OrderedDict[Hashable, list[tuple[str, int]]] = OrderedDict()
        self.spills = 0  # requests sent past their group's holders because every holder was over the gate

    def __len__(self) -> int:
        return len(self._holders)

    def choose(self, key: Hashable, candidates: Sequence[str], outstanding: Mapping[str, int],
               epochs: Mapping[str, int], least_loaded: Callable[[Sequence[str]], str]) -> str:
        """The replica for the next request of group `key`, among the live `candidates` (not empty)."""
        if not candidates:
            raise ValueError("no candidate replica")
        held = [url for url, epoch in self._holders.get(key, ()) if url in candidates and epochs.get(url) == epoch]
        if held:
            mean = sum(outstanding.get(url, 0) for url in candidates) / len(candidates)
            fit = [url for url in held if not self.gate.overloaded(outstanding.get(url, 0), mean)]
            if fit:
                self._holders.move_to_end(key)
                return min(fit, key=lambda url: outstanding.get(url, 0))  # the first holder among equals
            self.spills += 1
        chosen = least_loaded(candidates)
        self._remember(key, chosen, epochs.get(chosen, 0))
        return chosen

    def _remember(self, key: Hashable, url: str, epoch: int) -> None:
        holders = [(u, e) for u, e in self._holders.pop(key, []) if u != url]
        self._holders[key] = [*holders, (url, epoch)][-MAX_HOLDERS:]
        while len(self._holders) > self.max_groups:
            self._holders.popitem(last=False)


def dp_rank(key: Hashable, ranks: int) -> int:
    """The data-parallel scheduler of a group inside a replica with `ranks` of them: a stable hash, so every request
    of the group reaches the one scheduler whose radix cache holds its prefix (SGLang's own dispatch spreads them)."""
    if ranks < 1:
        raise ValueError("ranks must be at least 1")
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % ranks
