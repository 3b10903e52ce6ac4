"""Whether a request fits the server as it is, under the serving release's rules, before it is sent. Pure.

SGLang checks a request in three places, and only two of them answer with an error:
1. the tokenizer manager refuses (HTTP 400) a prompt of `context` tokens or more, and a prompt + max_new_tokens of
   `context` or more until 0.5.10.post1, of more than `context` from 0.5.11 (0.5.9
   managers/tokenizer_manager.py:761,781; 0.5.10.post1 managers/tokenizer_manager.py:815; 0.5.11
   managers/tokenizer_manager.py:845; 0.5.23 managers/tokenizer_manager.py:1338,1358);
2. the scheduler aborts (HTTP 400) a prompt of `max_req_input_len` = min(context - 1, pool - 1) - 5 tokens or more
   (0.5.9 managers/utils.py:111; 0.5.23 managers/utils.py:272);
3. and silently lowers max_new_tokens to max_req_len - prompt - 1, max_req_len = min(context - 1, pool - 1)
   (0.5.9 managers/scheduler.py:1392; 0.5.23 managers/scheduler.py:2714), and from 0.5.21 also to what an
   empty KV pool holds: pool - prompt rounded up to pages - one page - 1 (0.5.23 mem_cache/allocator/base.py:88).
A clamped request would come back `length`-truncated short of the max_new_tokens its row records, so the runner
refuses all three before sending, with the numbers and what to change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ..facts.releases import Release, version_key
from ..facts.server_info import INPUT_HEADROOM, ServerFacts

KV_MEMORY_CAP_SINCE = "0.5.21"


@dataclass(frozen=True)
class ServerLimits:
    """The strictest limits over the replicas: a request must fit whichever one it is sent to."""

    context_length: int
    # ">=": prompt + max_new_tokens == context is refused (until 0.5.10.post1); ">": only more than context.
    context_rule: Literal[">=", ">"] = ">="
    max_req_len: int | None = None  # min(context - 1, pool - 1), from /server_info max_req_input_len + 5
    max_total_num_tokens: int | None = None  # KV pool, for the 0.5.21+ memory cap
    page_size: int = 1
    memory_cap: bool = False
    release: str | None = None  # the serving release, for messages

    @classmethod
    def of(cls, context_length: int, servers: Sequence[ServerFacts]) -> ServerLimits:
        releases = [s.release for s in servers]
        known = [r for r in releases if r is not None]
        # An unknown release gets the strict rule of the oldest: a request refused needlessly costs one sample's
        # record, one sent and refused costs the same; one silently cut costs a wrong row.
        rule: Literal[">=", ">"] = ">" if known and len(known) == len(releases) and all(
            r.context_rule == ">" for r in known) else ">="
        req_lens = [s.max_req_len for s in servers if s.max_req_len]
        pools = [s.max_total_num_tokens for s in servers if s.max_total_num_tokens]
        return cls(
            context_length=context_length, context_rule=rule,
            max_req_len=min(req_lens) if req_lens else None,
            max_total_num_tokens=min(pools) if pools else None,
            page_size=max((s.page_size for s in servers), default=1),
            memory_cap=any(_memory_cap(r) for r in releases),
            release=_describe(known),
        )

    def most_new_tokens(self, prompt_tokens: int) -> int:
        """The largest max_new_tokens this prompt can ask for and be served as asked (may be negative)."""
        slack = 1 if self.context_rule == ">=" else 0
        best = self.context_length - prompt_tokens - slack
        if self.max_req_len is not None:
            best = min(best, self.max_req_len - prompt_tokens - 1)
        if self.memory_cap and self.max_total_num_tokens is not None:
            paged = -(-prompt_tokens // self.page_size) * self.page_size
            best = min(best, self.max_total_num_tokens - paged - self.page_size - 1)
        return best

    def misfit(self, prompt_tokens: int, max_new_tokens: int) -> str | None:
        """None when the request is served as asked; else why not, with the numbers (no advice)."""
        serving = f"SGLang {self.release}" if self.release else "the server"
        if prompt_tokens >= self.context_length:
            return (f"the prompt is {prompt_tokens} tokens, not less than the context length "
                    f"{self.context_length}")
        if self.max_req_len is not None and prompt_tokens >= self.max_req_len - INPUT_HEADROOM:
            return (f"the prompt is {prompt_tokens} tokens; {serving} accepts prompts of fewer than "
                    f"{self.max_req_len - INPUT_HEADROOM} (its KV pool holds {self.max_total_num_tokens} tokens, "
                    f"context length {self.context_length})")
        most = self.most_new_tokens(prompt_tokens)
        if max_new_tokens <= most:
            return None
        total = prompt_tokens + max_new_tokens
        if self.context_rule == ">=" and total >= self.context_length:
            why = f"{total} >= context length {self.context_length}, which {serving} refuses"
        elif total > self.context_length:
            why = f"{total} > context length {self.context_length}"
        else:
            pool = f", KV pool {self.max_total_num_tokens} tokens" if self.max_total_num_tokens else ""
            why = (f"{total} tokens, and {serving} would silently cut maxNewTokens to {max(0, most)} (it serves a "
                   f"request up to {prompt_tokens + most} tokens: context length {self.context_length}{pool})")
        return f"prompt {prompt_tokens} + maxNewTokens {max_new_tokens} = {why}"


def _memory_cap(release: Release | None) -> bool:
    return release is not None and version_key(release.version) >= version_key(KV_MEMORY_CAP_SINCE)


def _describe(known: list[Release]) -> str | None:
    versions = sorted({r.version for r in known}, key=version_key)
    return "/".join(versions) or None
