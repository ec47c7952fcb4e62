"""Cumulative per-op latency buckets in describe, so a client without Prometheus (kvcli top) can show
an interval p99: the difference of two snapshots' bucket counts is the interval's histogram.

Fixed log-spaced bounds (four per decade, 10 us .. 10 s) keep the map small and the same on every
server; counts only grow, like every counter in describe.
"""

from __future__ import annotations

import bisect
from typing import Any

BOUNDS_S: tuple[float, ...] = tuple(round(10 ** (e / 4) * 1e-5, 9) for e in range(25))  # 10 us .. 10 s
TRACKED = frozenset({"lookup", "retrieve", "store", "commit", "end_session", "query", "pin", "unpin", "clear"})


class LatencyBuckets:
    """Request latency by op (the ops an engine or operator waits on), in cumulative bucket counts."""

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}

    def observe(self, op: str, seconds: float, _code: str | None = None) -> None:
        if op not in TRACKED:
            return
        counts = self.counts.get(op)
        if counts is None:
            counts = self.counts[op] = [0] * (len(BOUNDS_S) + 1)  # the last bucket: slower than 10 s
        counts[bisect.bisect_left(BOUNDS_S, seconds)] += 1

    def describe(self) -> dict[str, Any]:
        return {"bounds_s": list(BOUNDS_S), "ops": {op: list(c) for op, c in self.counts.items()}}
