"""What the admin API shows a reader without a credential: aggregates, never who uses the server.

Loopback is reachable by every local user, so tenant names, quotas and per-tenant usage, and the
engines' ids, hosts, pids and layouts, need the server's token; totals stay open so a probe or a
token-less Prometheus still sees the server's health.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.registry import CollectorRegistry

TENANT_SERIES_PREFIX = "kvserver_tenant_"  # every per-tenant family (metrics.py _TENANT_SERIES)
ENGINE_PUBLIC_FIELDS = ("model", "world_size", "rank")  # no id, host, pid, layouts or time


def aggregate_status(described: dict[str, Any]) -> dict[str, Any]:
    """describe() without the tenant table and with engines reduced to what is not identifying."""
    out = {k: v for k, v in described.items() if k != "tenants"}
    out["engines"] = [{f: e.get(f) for f in ENGINE_PUBLIC_FIELDS} for e in described.get("engines", [])]
    out["view"] = "aggregate"  # says why tenants are missing: send the token for the full map
    return out


class AggregateRegistry:
    """A registry's families without the per-tenant ones (what a token-less scrape receives)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if not family.name.startswith(TENANT_SERIES_PREFIX):
                yield family
