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

A new group (the first request of a prompt or conversation) goes where the longest prefix of its prompt is already
cached, when some replica holds more of it than a block: prompts that share a system prompt, tools or a few-shot
preamble find it on the replica that prefilled it, as smg's cache_aware policy sends each request (issue 44). The
client cannot see the replicas' radix caches, so it keeps its own record of what it sent where: the prompt's leading
tokens in blocks of `BLOCK` tokens, each block named by a 64-bit hash of the whole prefix up to it
(`prefix_hashes`), and per name the replicas it went to; at most `MAX_BLOCKS` names, the least recently used
forgotten first (a replica's cache evicts the same way). Only the leading `MAX_PREFIX_BLOCKS` blocks of a group's first
request are recorded: a shared preamble is that long at most, and the rest of the group follows its affinity key.

A replica that is down is no candidate, so its groups move; a replica that went down and came back lost its
cache, so holders are remembered with the replica's outage count (its *epoch*) and forgotten when it changed, and
what it was sent before is forgotten too.
Pure: the caller passes the live replicas, their loads and epochs, and the least-loaded rule.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# smg's --balance-abs-threshold and --balance-rel-threshold defaults (smg 1.13.0 smg/router_args.py:90-91).
SPILL_ABS_THRESHOLD = 64
SPILL_REL_THRESHOLD = 1.5
MIN_SWING = 4.0  # "never under four unless this value is lower" (smg 1.13.0 smg/router_args.py:696-698)
# Groups remembered at once. A group is done when its last sample or turn is (the pipeline hands a prompt's samples
# out together), so this only has to outlast the requests in flight; the oldest group is forgotten first.
MAX_GROUPS = 65_536
MAX_HOLDERS = 8  # replicas remembered per group
BLOCK = 64  # tokens per recorded prefix block (SGLang's radix cache matches any length; this is the record's grain)
MAX_PREFIX_BLOCKS = 64  # blocks of a group's first prompt recorded: 4,096 tokens of shared preamble
MAX_BLOCKS = 32_768  # prefix names remembered over all replicas (~4 MB); the least recently used go first


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, on uint64 arrays (wrapping arithmetic): sums of mixed values do not cancel."""
    values = values ^ (values >> np.uint64(30))
    values = values * np.uint64(0xBF58476D1CE4E5B9)
    values = values ^ (values >> np.uint64(27))
    values = values * np.uint64(0x94D049BB133111EB)
    mixed: np.ndarray = values ^ (values >> np.uint64(31))
    return mixed


_POWERS = _mix(np.arange(1, BLOCK + 1, dtype=np.uint64))  # a weight per position in a block
_WEIGHTS = _mix(np.arange(1, MAX_PREFIX_BLOCKS + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
_LENGTHS = _mix(np.arange(MAX_PREFIX_BLOCKS, dtype=np.uint64) + np.uint64(0x632BE59BD9B4E019))


def prefix_hashes(ids: Sequence[int] | np.ndarray) -> list[int]:
    """A name per whole leading block of the prompt: the k-th names its first k blocks of `BLOCK` tokens (a hash of
    every token in them, in order), so two prompts' k-th names are equal when their first k blocks are. At most
    MAX_PREFIX_BLOCKS. A collision (2^-64) only misplaces a request, never changes what it generates."""
    tokens = np.asarray(ids, dtype=np.int64)
    blocks = min(tokens.size // BLOCK, MAX_PREFIX_BLOCKS)
    if blocks == 0:
        return []
    grid = tokens[:blocks * BLOCK].astype(np.uint64).reshape(blocks, BLOCK)
    with np.errstate(over="ignore"):
        each = _mix((grid * _POWERS).sum(axis=1, dtype=np.uint64))  # a block's tokens, each at its place
        named = np.cumsum(each * _WEIGHTS[:blocks], dtype=np.uint64) + _LENGTHS[:blocks]  # the blocks, in order
    return named.tolist()  # type: ignore[no-any-return]


class PrefixRecord:
    """Which replicas were sent which prefix blocks: a bit per replica under each block's name, bounded."""

    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._replicas: dict[str, int] = {}  # url -> its bit
        self._epochs: dict[str, int] = {}  # url -> the epoch its bit describes
        self._blocks: OrderedDict[int, int] = OrderedDict()  # name -> bits of the replicas sent it

    def __len__(self) -> int:
        return len(self._blocks)

    def _bit(self, url: str, epoch: int) -> int:
        bit = self._replicas.get(url)
        if bit is None:
            bit = self._replicas[url] = 1 << len(self._replicas)
            self._epochs[url] = epoch
        elif self._epochs[url] != epoch:  # it restarted: its cache is empty, whatever it was sent before
            self._epochs[url] = epoch
            for name, bits in list(self._blocks.items()):
                if bits & bit:
                    self._blocks[name] = bits & ~bit
        return bit

    def longest(self, names: Sequence[int], candidates: Sequence[str], epochs: Mapping[str, int]) -> tuple[int, list[str]]:
        """(blocks, replicas): the most leading blocks of `names` any candidate was sent, and the candidates sent
        that many."""
        bits = {self._bit(url, epochs.get(url, 0)): url for url in candidates}
        wanted = sum(bits)
        held = 0
        matched = 0
        for name in names:
            found = self._blocks.get(name, 0) & wanted
            if not found:
                break
            held, matched = found, matched + 1
            self._blocks.move_to_end(name)
        return matched, [url for bit, url in bits.items() if held & bit]

    def record(self, names: Sequence[int], url: str, epoch: int) -> None:
        bit = self._bit(url, epoch)
        blocks = self._blocks
        for name in names:
            blocks[name] = blocks.get(name, 0) | bit
            blocks.move_to_end(name)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)


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

    def __init__(self, gate: SpillGate | None = None, max_groups: int = MAX_GROUPS, by_prefix: bool = True) -> None:
        """`by_prefix=False`: a new group goes to the least-loaded replica whatever it shares with earlier ones (the
        routing before issue 44, for the benchmark)."""
        if max_groups < 1:
            raise ValueError("max_groups must be at least 1")
        self.gate = gate or SpillGate()
        self.max_groups = max_groups
        self._holders: OrderedDict[Hashable, list[tuple[str, int]]] = OrderedDict()
        self.prefixes = PrefixRecord() if by_prefix else None
        self.spills = 0  # requests sent past their group's holders because every holder was over the gate
        self.placed_by_prefix = 0  # new groups sent where a shared prefix was (a block or more)

    def __len__(self) -> int:
        return len(self._holders)

    def choose(self, key: Hashable, candidates: Sequence[str], outstanding: Mapping[str, int],
               epochs: Mapping[str, int], least_loaded: Callable[[Sequence[str]], str],
               prefix: Callable[[], Sequence[int]] | None = None) -> str:
        """The replica for the next request of group `key`, among the live `candidates` (not empty). `prefix()`
        names the request's leading blocks (`prefix_hashes`); it is asked only for a group's first request."""
        if not candidates:
            raise ValueError("no candidate replica")
        holders = self._holders.get(key)
        mean = -1.0
        if holders:
            held = [url for url, epoch in holders if url in candidates and epochs.get(url) == epoch]
            if held:
                mean = sum(outstanding.get(url, 0) for url in candidates) / len(candidates)
                fit = [url for url in held if not self.gate.overloaded(outstanding.get(url, 0), mean)]
                if fit:
                    self._holders.move_to_end(key)
                    return min(fit, key=lambda url: outstanding.get(url, 0))  # the first holder among equals
                self.spills += 1
        names = prefix() if prefix is not None and self.prefixes is not None else ()
        chosen = self._by_prefix(names, candidates, outstanding, epochs, mean) if names else None
        if chosen is None:
            chosen = least_loaded(candidates)
        else:
            self.placed_by_prefix += 1
        epoch = epochs.get(chosen, 0)
        self._remember(key, chosen, epoch)
        if names and self.prefixes is not None:
            self.prefixes.record(names, chosen, epoch)
        return chosen

    def _by_prefix(self, names: Sequence[int], candidates: Sequence[str], outstanding: Mapping[str, int],
                   epochs: Mapping[str, int], mean: float) -> str | None:
        """The least loaded of the candidates that were sent the longest part of the prompt (a block at least),
        unless each is past the spill gate; None: no candidate shares a block with it."""
        assert self.prefixes is not None
        matched, holding = self.prefixes.longest(names, candidates, epochs)
        if not matched:
            return None
        if mean < 0:
            mean = sum(outstanding.get(url, 0) for url in candidates) / len(candidates)
        fit = [url for url in holding if not self.gate.overloaded(outstanding.get(url, 0), mean)]
        return min(fit, key=lambda url: outstanding.get(url, 0)) if fit else None

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
