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


def duration(seconds: int) -> str:
    """An ETA for people: 57h 12m, 3m 20s."""
    hours, rest = divmod(max(0, int(seconds)), 3600)
    minutes, secs = divmod(rest, 60)
    if hours >= 24:
        return f"{hours // 24}d {hours % 24}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {secs:02d}s"
