"""The prefix cache behind `meta_info.cached_tokens`: a radix tree of the prompts admitted, token-exact, bounded.

SGLang matches a new request's prompt, all but its last token, against its radix cache and reports the matched
length as `cached_tokens` (0.5.9 managers/schedule_batch.py:888-924 `max_prefix_len = input_len - 1`, and 1532-1536:
counted once, not again after a retraction). Prompts sharing a system prompt or a tool list hit that shared prefix.
The tree here holds at most `capacity` tokens and evicts the least recently used leaves first, as SGLang's does when
the KV pool needs room. Edges hold their tokens in compact arrays, so the memory is about 8 bytes per cached token.
Pure: no I/O.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

EVICT_TO = 0.9  # when over capacity, evict down to this share of it (eviction walks the tree)


@dataclass(eq=False)
class _Node:
    key: array[int]  # the tokens on the edge into this node
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    last_used: int = 0


def _common(a: array[int], b: array[int]) -> int:
    """Length of the common prefix of two arrays."""
    size = min(len(a), len(b))
    if a[:size] == b[:size]:
        return size
    low, high = 0, size  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low


class PrefixCache:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1 token")
        self.capacity = capacity
        self.tokens = 0
        self._root = _Node(array("q"), None)
        self._clock = itertools.count(1)

    def match(self, ids: Sequence[int]) -> int:
        """How many leading tokens of `ids` are cached (and mark them used)."""
        key = array("q", ids)
        node, matched = self._root, 0
        now = next(self._clock)
        while matched < len(key):
            child = node.children.get(key[matched])
            if child is None:
                break
            common = _common(child.key, key[matched:matched + len(child.key)])
            child.last_used = now
            matched += common
            if common < len(child.key):
                break
            node = child
        return matched

    def insert(self, ids: Sequence[int]) -> None:
        key = array("q", ids)
        node, done = self._root, 0
        now = next(self._clock)
        while done < len(key):
            child = node.children.get(key[done])
            if child is None:
                leaf = _Node(key[done:], node, last_used=now)
                node.children[key[done]] = leaf
                self.tokens += len(leaf.key)
                break
            common = _common(child.key, key[done:done + len(child.key)])
            child.last_used = now
            if common < len(child.key):
                child = self._split(child, common)
            done += common
            node = child
        if self.tokens > self.capacity:
            self._evict(int(self.capacity * EVICT_TO))

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut the edge into `child` after `at` tokens; the new middle node."""
        parent = child.parent
        assert parent is not None
        middle = _Node(child.key[:at], parent, {child.key[at]: child}, child.last_used)
        parent.children[child.key[0]] = middle
        child.key = child.key[at:]
        child.parent = middle
        return middle

    def _evict(self, target: int) -> None:
        order = itertools.count()
        heap = [(leaf.last_used, next(order), leaf) for leaf in self._leaves()]
        heapq.heapify(heap)
        while self.tokens > target and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self.tokens -= len(leaf.key)
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last_used, next(order), parent))

    def _leaves(self) -> list[_Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out
