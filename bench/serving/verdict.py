"""Verdicts for the serving benchmark's figures over repeated rounds (no I/O, no engines).

Each configuration runs once per round (bench/serving/repeats.py: alternating order, the same
requests every round). For one figure of one workload this module takes the per-round values of a
configuration and of the baseline (`none`) and says:

- the median and range [min-max] of each;
- the per-round ratio (configuration / baseline of the same round), its median and range;
- a verdict: "better" or "worse" when the two configurations' per-round ranges do not overlap, or,
  from `SIGN_ROUNDS` rounds on, when every round's ratio lies on the same side of 1.0 (the ratio's
  range excludes 1.0); otherwise "within noise". Which side is better depends on the figure
  (throughput up, latency and CPU down). Fewer than `min_rounds` rounds of either give "too few
  rounds": one round's difference on a shared host says nothing about the next.

How often a verdict is wrong: when a configuration changes nothing, its rounds and the baseline's
are draws of the same noise, and every ordering of them is equally likely. Ranges of n rounds each
then fail to overlap with probability 2 / C(2n, n): 10% at 3 rounds, 2.9% at 4, 0.8% at 5. Every
paired ratio lands on one side of 1.0 with probability 2 / 2^n: 25% at 3 rounds (one "better" or
"worse" in four figures that nothing changed), 6.3% at 5; hence that rule waits for 5 rounds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

BETTER, WORSE, NOISE, TOO_FEW = "better", "worse", "within noise", "too few rounds"
MIN_ROUNDS = 3
SIGN_ROUNDS = 5  # paired ratios all on one side decide from here (a 6.3% false verdict, 25% at 3 rounds)


@dataclass(frozen=True)
class Span:
    median: float
    lo: float
    hi: float

    @classmethod
    def of(cls, xs: Sequence[float]) -> Span | None:
        if not xs:
            return None
        return cls(statistics.median(xs), min(xs), max(xs))

    def fmt(self, spec: str) -> str:
        return f"{self.median:{spec}} [{self.lo:{spec}}-{self.hi:{spec}}]"


def overlap(a: Span, b: Span) -> bool:
    return a.lo <= b.hi and b.lo <= a.hi


def paired_ratios(mine: Sequence[float | None], base: Sequence[float | None]) -> list[float]:
    """mine[i] / base[i] for every round i where both ran and the baseline is not 0."""
    return [m / b for m, b in zip(mine, base, strict=True) if m is not None and b is not None and b != 0]


@dataclass(frozen=True)
class Verdict:
    mine: Span | None
    base: Span | None
    ratio: Span | None
    verdict: str


def judge(
    mine: Sequence[float | None],
    base: Sequence[float | None],
    higher_is_better: bool,
    min_rounds: int = MIN_ROUNDS,
) -> Verdict:
    """`mine` and `base`: one value per round (None where that configuration failed in the round)."""
    if len(mine) != len(base):
        raise ValueError("one value per round for both configurations")
    m = [x for x in mine if x is not None]
    b = [x for x in base if x is not None]
    ms, bs, rs = Span.of(m), Span.of(b), Span.of(paired_ratios(mine, base))
    if ms is None or bs is None or len(m) < min_rounds or len(b) < min_rounds:
        return Verdict(ms, bs, rs, TOO_FEW)
    up: bool | None = None  # did the figure go up against the baseline, beyond the noise?
    if not overlap(ms, bs):
        up = ms.lo > bs.hi
    elif rs is not None and len(paired_ratios(mine, base)) >= SIGN_ROUNDS and (rs.lo > 1.0 or rs.hi < 1.0):
        up = rs.lo > 1.0
    if up is None:
        return Verdict(ms, bs, rs, NOISE)
    return Verdict(ms, bs, rs, BETTER if up == higher_is_better else WORSE)


def false_verdict_rate(rounds: int) -> float:
    """The chance that `judge` says "better" or "worse" of a configuration that changes nothing, at
    `rounds` rounds of both: the ranges' non-overlap, plus, from SIGN_ROUNDS, the paired signs
    (bounded by the sum; the two events mostly coincide)."""
    if rounds < MIN_ROUNDS:
        return 0.0
    ranges = 2 / math.comb(2 * rounds, rounds)
    signs = 2 / 2**rounds if rounds >= SIGN_ROUNDS else 0.0
    return min(1.0, ranges + signs)
