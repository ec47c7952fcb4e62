"""Is a load worth it? The connector's online estimate of load throughput and prefill rate.

Why: loading is not always faster than recomputing (a tiny model prefills faster than a round trip
to the server). The workers measure what each load cost (seconds for tokens) and what each
prefill-heavy step cost (seconds for the tokens it computed) and report both with every step's
worker metadata; the scheduler keeps exponentially weighted rates and loads a hit only when that is
estimated cheaper than recomputing it.

The load rate is seeded at start by each worker's calibration (`calibrate.py`: a server round trip
and a copy of one chunk's blocks, no cache traffic), the prefill rate by the first prefill step;
until both are known, loads are taken (optimistic start). A declined hit teaches nothing, so after
PROBE_EVERY declines in a row one hit is loaded anyway: a server that got faster (or an engine
that got busier) is noticed. One CostModel per connector: a connector serves one layout.
"""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.3  # weight of the newest observation
MIN_PREFILL_TOKENS = 32  # steps computing fewer tokens are decode-dominated: not a prefill rate
PROBE_EVERY = 16  # after this many declined hits in a row, load the next one to measure again


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
    load: Rate  # every load: what a hit costs to bring (the planner's)
    prefill: Rate
    in_step: Rate  # loads copied inside the step: a copy's own cost, to place a load (fits_in_step)
    declined_in_a_row: int = 0

    @classmethod
    def new(cls) -> CostModel:
        return cls(Rate(), Rate(), Rate())

    def observe(
        self,
        load_tokens: float,
        load_s: float,
        prefill_tokens: float,
        prefill_s: float,
        in_step_tokens: float = 0,
        in_step_s: float = 0.0,
    ) -> None:
        if load_tokens > 0:
            self.load.observe(load_tokens, load_s)
        if in_step_tokens > 0:
            self.in_step.observe(in_step_tokens, in_step_s)
        if prefill_tokens >= MIN_PREFILL_TOKENS:
            self.prefill.observe(prefill_tokens, prefill_s)

    def cheaper_to_load(self, tokens: int) -> bool:
        """True unless both rates are known and recomputing `tokens` is estimated cheaper."""
        if tokens <= 0 or self.load.s_per_token is None or self.prefill.s_per_token is None:
            return True
        return tokens * self.load.s_per_token <= tokens * self.prefill.s_per_token

    def fits_in_step(self, tokens: int, step_s: float | None, share: float) -> bool:
        """Is copying `tokens` inside the step estimated to take at most `share` of a step of `step_s`
        seconds? From the in-step rate only: background copies on a busy host are timed with their
        waits for the CPU, and would keep every load in the background once some were. False while
        either is unknown (a load of unknown cost goes to the background)."""
        if self.in_step.s_per_token is None or step_s is None or share <= 0:
            return False
        return tokens * self.in_step.s_per_token <= share * step_s

    def worth_loading(self, tokens: int) -> bool:
        """The decision for one hit: load it when cheaper, and every PROBE_EVERY-th declined hit anyway."""
        if self.cheaper_to_load(tokens):
            self.declined_in_a_row = 0
            return True
        self.declined_in_a_row += 1
        if self.declined_in_a_row > PROBE_EVERY:
            self.declined_in_a_row = 0
            return True  # a probe: its measured cost updates the load rate
        return False
