"""Numbers for people, in the plan's reasoning and its errors: GiB, bytes per token, element sizes, counts."""

from __future__ import annotations


def gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def per_token(n: int) -> str:
    return f"{n:,} B ({n / 1024:,.1f} KiB)"


def elements(element_bytes: float) -> str:
    return f"{element_bytes:.3g} B"


def count(n: int, word: str) -> str:
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"
