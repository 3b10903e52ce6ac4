"""A local store that counts what a reader reads and lists, and a way to commit shards at a chosen time."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

from tokenmill_runner.store.ledger import ShardContent
from tokenmill_runner.store.shards import commit_shard
from tokenmill_runner.store.storage import LocalStorage


class CountingStorage(LocalStorage):
    """A local store that counts the objects read and the keys listed, as an S3 bill would."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.gets: list[str] = []
        self.listed = 0

    def get(self, key: str) -> bytes:
        self.gets.append(key)
        return super().get(key)

    def open_read(self, key: str):  # bounded reads (store/bounded_get.py) are reads of the object too
        self.gets.append(key)
        return super().open_read(key)

    def _walk(self, prefix: str, start_after: str | None) -> Iterator[tuple[str, str]]:  # list and list_sizes
        for item in super()._walk(prefix, start_after):
            self.listed += 1
            yield item

    def reset(self) -> None:
        self.gets, self.listed = [], 0


def rows(dataset: str, lines: range, tokens: int = 10) -> list[dict[str, Any]]:
    return [{"sample_id": f"s{line}", "dataset": dataset, "line": line, "sample_index": 0, "prompt_ids": [1],
             "output_ids": [2] * tokens, "prompt_tokens": 1, "completion_tokens": tokens, "finish_reason": "stop"}
            for line in lines]


def commit_lines(storage, dataset: str, seq: int, lines: range, at: datetime,
                 errors: list[dict[str, Any]] = (), worker: int = 0) -> dict[str, Any]:
    """Commit rows for `lines` as shard w<worker>-t-<seq>, its marker named at `at`."""
    return commit_shard(storage, dataset, f"w{worker:03d}-t-{seq:06d}", worker,
                        ShardContent(rows(dataset, lines), list(errors)), clock=lambda: at)
