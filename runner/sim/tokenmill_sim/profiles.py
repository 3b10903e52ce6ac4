"""Output-length profiles: long-tailed length distributions as plain data, drawn with a caller's RNG.

Each profile is a mixture of log-normal components. `glaive` is fitted to the seeds' B1_glaive figures (Kimi-K2.5,
function calling, max_new_tokens 10240): p10 113, p25 150, median 471, p75 ~2000, p90 ~3700, mean ~1360 with about
3 % of outputs running past the 10240 cap. A single log-normal cannot hold both the p90 and the 3 % at the cap, so a
small "runaway" component stands for generations that loop until whatever cap is set. The fitted mixture gives
p10 102, p25 138, median 474, p75 1841, p90 3800 and 3.1 % beyond 10240 (see `quantile`). Its median sits in the
valley between the two modes, so a sample's median moves more than its other quantiles, as in the seeds' data.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

AUTO = "auto"
SWE_PROMPT_TOKENS = 1500  # auto: prompts at least this long are agentic coding sessions


@dataclass(frozen=True)
class LogNormal:
    weight: float  # mixture weight; a profile's weights sum to 1
    median: float  # tokens
    sigma: float  # standard deviation of ln(length)


@dataclass(frozen=True)
class LengthProfile:
    name: str
    components: tuple[LogNormal, ...]
    reasoning_share: tuple[float, float]  # share of the output spent before </think>, drawn uniformly in [lo, hi]
    min_tokens: int = 24
    max_tokens: int = 262_144  # no draw is longer, whatever max_new_tokens allows

    def draw(self, rng: random.Random) -> int:
        """One output length in tokens (the natural length, before any max_new_tokens cut)."""
        pick = rng.random()
        component = self.components[-1]
        for candidate in self.components:
            if pick < candidate.weight:
                component = candidate
                break
            pick -= candidate.weight
        length = component.median * math.exp(component.sigma * rng.gauss(0.0, 1.0))
        return int(min(self.max_tokens, max(self.min_tokens, round(length))))

    def cdf(self, tokens: float) -> float:
        """P(length <= tokens), ignoring the min/max clamps (they only move mass already at the extremes)."""
        total = 0.0
        for c in self.components:
            z = (math.log(tokens) - math.log(c.median)) / c.sigma
            total += c.weight * 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))
        return total

    def quantile(self, share: float) -> float:
        """The length below which `share` of draws fall (bisection on cdf)."""
        low, high = 1.0, float(self.max_tokens) * 16
        for _ in range(100):
            middle = math.sqrt(low * high)
            low, high = (middle, high) if self.cdf(middle) < share else (low, middle)
        return low


PROFILES: dict[str, LengthProfile] = {
    # Function calling: a short mode (brief reasoning, then a tool call) and a long mode, plus runaways.
    "glaive": LengthProfile(
        name="glaive",
        components=(LogNormal(0.47, 134.0, 0.34), LogNormal(0.505, 1650.0, 0.8), LogNormal(0.025, 40_000.0, 0.35)),
        reasoning_share=(0.55, 0.9),
    ),
    # Open reasoning sets (B4/B5-like): long chains of thought, p90 near 9000, a visible share past 10k.
    "reasoning": LengthProfile(
        name="reasoning",
        components=(LogNormal(1.0, 2500.0, 1.0),),
        reasoning_share=(0.75, 0.95),
    ),
    # Agentic coding sessions (B8-like): long prompts, medium-length outputs.
    "swe": LengthProfile(
        name="swe",
        components=(LogNormal(1.0, 1200.0, 1.11),),
        reasoning_share=(0.6, 0.9),
    ),
}

# A few outputs in every dataset are a short clarifying question instead of an answer (the seeds show a valid
# 92-token sample); they are drawn apart from the profile so every profile has them.
CLARIFICATION_SHARE = 0.02
CLARIFICATION_REASONING_TOKENS = (30, 50)


def choose_profile(configured: str, prompt_tokens: int, declares_tools: bool) -> LengthProfile:
    """The profile for one prompt: the configured one, or for `auto` one picked from the prompt's features."""
    if configured != AUTO:
        return PROFILES[configured]
    if declares_tools:
        return PROFILES["glaive"]
    if prompt_tokens >= SWE_PROMPT_TOKENS:
        return PROFILES["swe"]
    return PROFILES["reasoning"]
