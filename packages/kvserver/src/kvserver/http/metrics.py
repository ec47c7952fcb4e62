"""Prometheus metrics of one kvserver, on a private registry (never the process-global one).

Counters and gauges are read from `KVServer.describe()` at scrape time (one source of truth, nothing
to keep in sync, L2 tiers included when describe reports them); request latency is the only thing
observed as it happens, through `KVServer.observers`. Labels stay bounded: op, tier, error code,
HTTP route template and status; never request ids, salts or engine ids.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from ..server import KVServer

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)
_TIER_RE = re.compile(r"^[a-z0-9_.:-]{1,32}$")
# keys an L2 tier entry of describe()["l2"] may carry, in order of preference
_L2_KEYS = {
    "objects": ("objects",),
    "used_bytes": ("used_bytes", "bytes"),
    "store_bytes": ("put_bytes", "stored_bytes", "bytes_written"),
    "retrieve_bytes": ("get_bytes", "retrieved_bytes", "bytes_read"),
    "evictions": ("evictions",),
}


@dataclass(frozen=True)
class TierStats:
    tier: str
    objects: float | None = None
    used_bytes: float | None = None
    store_bytes: float | None = None
    retrieve_bytes: float | None = None
    evictions: float | None = None


def _number(entry: Mapping[str, Any], names: tuple[str, ...]) -> float | None:
    for name in names:
        value = entry.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None


def tier_stats(described: Mapping[str, Any]) -> list[TierStats]:
    """Per-tier numbers from a describe() map: L1 always, then one entry per L2 tier it reports."""
    l1, counters = described["l1"], described["counters"]
    tiers = [TierStats("l1", l1["objects"], l1["used_bytes"], counters["stored_bytes"],
                       counters["retrieved_bytes"], l1["evictions"])]
    seen = {"l1"}
    l2 = described.get("l2")
    for i, entry in enumerate(l2 if isinstance(l2, list) else []):
        if not isinstance(entry, Mapping):
            continue
        name = next((str(entry[k]) for k in ("tier", "name", "kind") if isinstance(entry.get(k), str)), "")
        label = name if _TIER_RE.match(name) and name not in seen else f"l2.{i}"
        seen.add(label)
        tiers.append(TierStats(label, **{field: _number(entry, keys) for field, keys in _L2_KEYS.items()}))
    return tiers


def _per_tier(metric: CounterMetricFamily | GaugeMetricFamily, tiers: list[TierStats], field: str) -> Metric:
    for t in tiers:
        value = getattr(t, field)
        if value is not None:
            metric.add_metric([t.tier], value)
    return metric


class ServerCollector(Collector):
    """Reads one describe() per scrape and turns it into metric families."""

    def __init__(self, server: KVServer) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        d = self.server.describe()
        c, l1 = d["counters"], d["l1"]
        tiers = tier_stats(d)
        yield InfoMetricFamily("kvserver_build", "kvserver build", value={"version": str(d["version"])})
        yield CounterMetricFamily("kvserver_lookup_requests", "Lookups served.", value=c["lookups"])
        yield CounterMetricFamily("kvserver_lookup_tokens", "Tokens asked about by lookups.",
                                  value=c["lookup_tokens"])
        yield CounterMetricFamily("kvserver_lookup_hit_tokens", "Tokens lookups found reusable (prefix hits).",
                                  value=c["lookup_hit_tokens"])
        yield _per_tier(CounterMetricFamily("kvserver_store_bytes", "Bytes stored, per tier.", labels=["tier"]),
                        tiers, "store_bytes")
        yield _per_tier(CounterMetricFamily("kvserver_retrieve_bytes", "Bytes retrieved, per tier.",
                                            labels=["tier"]), tiers, "retrieve_bytes")
        yield _per_tier(GaugeMetricFamily("kvserver_objects", "Ready objects held, per tier.", labels=["tier"]),
                        tiers, "objects")
        yield _per_tier(GaugeMetricFamily("kvserver_tier_used_bytes", "Bytes held, per tier.", labels=["tier"]),
                        tiers, "used_bytes")
        yield _per_tier(CounterMetricFamily("kvserver_evictions", "Objects evicted, per tier.", labels=["tier"]),
                        tiers, "evictions")
        yield GaugeMetricFamily("kvserver_l1_used_bytes", "L1 arena bytes allocated.", value=l1["used_bytes"])
        yield GaugeMetricFamily("kvserver_l1_capacity_bytes", "L1 arena size.", value=l1["capacity_bytes"])
        yield GaugeMetricFamily("kvserver_leases_active", "Objects held by at least one read lease.",
                                value=l1["leased"])
        yield GaugeMetricFamily("kvserver_pinned_objects", "Objects pinned in L1.", value=l1["pinned"])
        yield GaugeMetricFamily("kvserver_sessions_active", "Live lookup sessions.", value=d["sessions"])
        yield GaugeMetricFamily("kvserver_stores_in_flight", "Reserved stores not yet committed.",
                                value=d["stores_in_flight"])
        yield GaugeMetricFamily("kvserver_engines", "Registered engine ranks.", value=len(d["engines"]))
        yield GaugeMetricFamily("kvserver_uptime_seconds", "Seconds since the server started.", value=d["uptime_s"])
        yield CounterMetricFamily("kvserver_lookup_dedup_objects", "Store requests for objects already present.",
                                  value=c["deduplicated_objects"])
        yield CounterMetricFamily("kvserver_no_space", "Object reservations refused because L1 was full.",
                                  value=c["no_space"])
        errors = CounterMetricFamily("kvserver_errors", "Error replies, by error code.", labels=["code"])
        for code, n in sorted(d["errors"].items()):
            errors.add_metric([code], n)
        yield errors


class ServerMetrics:
    """The registry of one server: scrape-time collector, latency histogram and HTTP counters."""

    def __init__(self, server: KVServer) -> None:
        disable_created_metrics()  # *_created series only add noise here (process-wide switch)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ServerCollector(server))
        self.request_seconds = Histogram("kvserver_request_seconds", "Control-plane request latency, by op.",
                                         ["op"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.http_requests = Counter("kvserver_http_requests", "Admin API requests, by route and status.",
                                     ["route", "status"], registry=self.registry)
        server.observers.append(self.observe)

    def observe(self, op: str, seconds: float, _code: str | None) -> None:
        self.request_seconds.labels(op).observe(seconds)
