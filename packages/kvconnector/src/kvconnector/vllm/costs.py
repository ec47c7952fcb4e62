"""Is a load worth it? The connector's online estimate of load throughput and prefill rate.

Why: loading is not always faster than recomputing (a tiny model prefills faster than a round trip
to the server). The workers measure what each load cost (seconds for tokens) and what each
prefill-heavy step cost (seconds for the tokens it computed) and report both with every step's
worker metadata; the scheduler keeps exponentially weighted rates and loads a hit only when that is
estimated cheaper than recomputing it. Until both rates are known, loads are taken (optimistic
start). One CostModel per connector: a connector serves one layout.
"""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.3  # weight of the newest observation
MIN_PREFILL_TOKENS = 32  # steps computing fewer tokens are decode-dominated: not a prefill rate


@dataclass
class Rate:
    """Seconds per token, smoothed; None until observed."""

    s_per_token: float | None = None

    def observe(self, tokens: float, seconds: float) -> None:
        if tokens <= 0 or seconds < 0:
            return
        x = seconds / tokens
        self.s_per_token = x if self.s_per_token is None else (1 - ALPHA) * self.s_per_token + ALPHA * x


@dataclass
class CostModel:
    load: Rate
    prefill: Rate

    @classmethod
    def new(cls) -> CostModel:
        return cls(Rate(), Rate())

    def observe(self, load_tokens: float, load_s: float, prefill_tokens: float, prefill_s: float) -> None:
        if load_tokens > 0:
            self.load.observe(load_tokens, load_s)
        if prefill_tokens >= MIN_PREFILL_TOKENS:
            self.prefill.observe(prefill_tokens, prefill_s)

    def worth_loading(self, tokens: int) -> bool:
        """True unless both rates are known and recomputing `tokens` is estimated cheaper."""
        if tokens <= 0 or self.load.s_per_token is None or self.prefill.s_per_token is None:
            return True
        return tokens * self.load.s_per_token <= tokens * self.prefill.s_per_token
