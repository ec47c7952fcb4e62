"""Is a load worth it? The connector's online estimate of load throughput and prefill rate.

Why: loading is not always faster than recomputing (a tiny model prefills faster than a round trip
to the server). The workers measure what each load cost (seconds for tokens) and what each
prefill-heavy step cost (seconds for the tokens it computed) and report both with every step's
worker metadata; the scheduler keeps exponentially weighted rates and loads a hit only when that is
estimated cheaper than recomputing it.

The load rates are seeded at start by each worker's calibration (`calibrate.py`: server round trips,
the fixed part of a load, and a copy of one chunk's blocks, no cache traffic), the prefill rate by
the first prefill step;
until both are known, loads are taken (optimistic start). A declined hit teaches nothing, so after
PROBE_EVERY declines in a row one hit is loaded anyway: a server that got faster (or an engine
that got busier) is noticed. One CostModel per connector: a connector serves one layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
class LoadRate:
    """A load's cost: a fixed part per load (its round trips to the server) and a part per token (its
    copy and checksum). Why two parts: a rate per token alone, learned from a one-chunk calibration,
    charges a large hit one round trip per chunk and sends it to the background for nothing.

    The fixed part comes from the calibration's round trips; samples teach the per-token part (their
    seconds less the fixed part of their loads). A sample faster than its loads' fixed part lowers
    that at once: every load pays the round trips, so no load is faster than them, and a calibration
    that met a busy host (engines starting side by side) would otherwise decline hits for a while."""

    fixed_s: float = 0.0
    per_token: Rate = field(default_factory=Rate)

    def observe(self, loads: int, tokens: float, seconds: float) -> None:
        if tokens <= 0 or seconds < 0:
            return
        loads = max(1, loads)
        rest = seconds - loads * self.fixed_s
        if rest < 0:
            self.fixed_s = seconds / loads
            rest = 0.0
        self.per_token.observe(tokens, rest)

    def estimate(self, tokens: int) -> float | None:
        """Seconds one load of `tokens` is estimated to take; None until a sample was seen."""
        if self.per_token.s_per_token is None:
            return None
        return self.fixed_s + tokens * self.per_token.s_per_token


@dataclass
class CostModel:
    load: LoadRate  # every load: what a hit costs to bring (the planner's)
    prefill: Rate
    in_step: LoadRate  # loads copied inside the step: a copy's own cost, to place a load (fits_in_step)
    declined_in_a_row: int = 0

    @classmethod
    def new(cls) -> CostModel:
        return cls(LoadRate(), Rate(), LoadRate())

    def calibrated(self, fixed_s: float) -> None:
        """The workers' measured fixed cost of one load (calibrate.py), before its first sample."""
        if fixed_s > 0:
            self.load.fixed_s = self.in_step.fixed_s = fixed_s

    def observe_loads(self, loads: int, tokens: float, seconds: float, *, in_step: bool) -> None:
        """A step's loads (all of them, or those copied inside the step): how many, tokens, seconds."""
        if tokens > 0:
            (self.in_step if in_step else self.load).observe(loads, tokens, seconds)

    def observe_prefill(self, tokens: float, seconds: float) -> None:
        if tokens >= MIN_PREFILL_TOKENS:
            self.prefill.observe(tokens, seconds)

    def cheaper_to_load(self, tokens: int) -> bool:
        """True unless both rates are known and recomputing `tokens` is estimated cheaper."""
        load_s = self.load.estimate(tokens)
        if tokens <= 0 or load_s is None or self.prefill.s_per_token is None:
            return True
        return load_s <= tokens * self.prefill.s_per_token

    def fits_in_step(self, tokens: int, step_s: float | None, share: float) -> bool:
        """Is copying `tokens` inside the step estimated to take at most `share` of a step of `step_s`
        seconds? From the in-step rate only: background copies on a busy host are timed with their
        waits for the CPU, and would keep every load in the background once some were. False while
        either is unknown (a load of unknown cost goes to the background)."""
        load_s = self.in_step.estimate(tokens)
        if load_s is None or step_s is None or share <= 0:
            return False
        return load_s <= share * step_s

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
