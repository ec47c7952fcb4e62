"""Latency percentiles and throughput figures for bench reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Latencies:
    """Seconds per operation, kept raw so any percentile can be reported."""

    samples: dict[str, list[float]] = field(default_factory=dict)

    def add(self, op: str, seconds: float) -> None:
        self.samples.setdefault(op, []).append(seconds)

    def summary(self, ops: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        """{op: {count, p50, p90, p99, mean} in milliseconds}; ops never measured report count 0."""
        out: dict[str, dict[str, Any]] = {}
        for op in ops:
            values = np.asarray(self.samples.get(op, []), dtype=np.float64) * 1000
            if values.size == 0:
                out[op] = {"count": 0, "p50": None, "p90": None, "p99": None, "mean": None}
                continue
            p50, p90, p99 = np.percentile(values, [50, 90, 99])
            out[op] = {
                "count": int(values.size),
                "p50": round(float(p50), 3),
                "p90": round(float(p90), 3),
                "p99": round(float(p99), 3),
                "mean": round(float(values.mean()), 3),
            }
        return out

    def total(self, op: str) -> float:
        return float(sum(self.samples.get(op, [])))


def gbps(nbytes: int, seconds: float) -> float | None:
    """Decimal GB/s, or None when nothing was timed."""
    return round(nbytes / seconds / 1e9, 4) if seconds > 0 and nbytes else None
