"""The EC connector's counters in vLLM's own stats path (`SchedulerStats.ec_connector_stats`).

Why: vLLM's stat loggers show what connectors report through `get_ec_connector_stats`; the
scheduler side reports, per step, items asked about (`ec_lookups`), found (`ec_hits`) and planned
as loads instead of encoder runs (`ec_loads_planned`). vLLM 0.32's CPU/GPU model runner does not
forward worker-side EC stats, so loads done, saves and fallbacks stay in the connector's log.
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorStats


class KVServerECStats(ECConnectorStats):
    """Counters by name (`data`, from the base dataclass); steps and workers add up."""

    def reset(self) -> None:
        self.data.clear()

    def aggregate(self, other: ECConnectorStats) -> KVServerECStats:
        for name, value in (other.data or {}).items():
            if isinstance(value, int | float):
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if isinstance(v, int | float)}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class StatDelta:
    """Counters since the last `take()`."""

    def __init__(self) -> None:
        self.data: dict[str, int] = {}

    def add(self, name: str, n: int = 1) -> None:
        self.data[name] = self.data.get(name, 0) + n

    def take(self) -> KVServerECStats | None:
        if not any(self.data.values()):
            return None
        out, self.data = KVServerECStats(data=dict(self.data)), {}
        return out


def build_stats(data: Mapping[str, float] | None) -> KVServerECStats:
    return KVServerECStats(data=dict(data or {}))
