"""Prometheus metrics of one kvserver, on a private registry (never the process-global one).

Counters and gauges are read from `AdminBackend.describe()` at scrape time (one source of truth, nothing
to keep in sync, L2 tiers included when describe reports them); request latency is the only thing
observed as it happens, through `AdminBackend.observers`. Labels stay bounded: op, tier, error code,
HTTP route template and status; never request ids, salts or engine ids.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvprotocol import ErrorCode
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from .backend import AdminBackend
from .ec_metrics import ec_families

LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
_TIER_RE = re.compile(r"^[a-z0-9_.:-]{1,32}$")
# TierStats field -> the key an L2 tier's entry of describe()["l2"] carries it under (l2/tier.py)
_L2_KEYS = {
    "objects": "objects",
    "used_bytes": "bytes",
    "store_bytes": "put_bytes",
    "retrieve_bytes": "get_bytes",
    "hits": "hits",
    "misses": "misses",
    "errors": "errors",
    "corrupt": "corrupt",
    "dropped": "dropped",
    "retried": "retried",
    "up": "up",
}
# describe()["l2_queue"] key -> (metric name, type, help)
_L2_QUEUE = {
    "queued": ("kvserver_l2_queue_depth", "gauge", "Objects waiting in the L2 write-behind queue."),
    "capacity": ("kvserver_l2_queue_capacity", "gauge", "Length of the L2 write-behind queue."),
    "dropped": ("kvserver_l2_queue_dropped", "counter", "Write-behind objects dropped because the queue was full."),
    "prefetched_objects": ("kvserver_l2_prefetched_objects", "counter", "Objects loaded from L2 into L1 on lookups."),
    "prefetch_timeouts": ("kvserver_l2_prefetch_timeouts", "counter", "Lookups that stopped waiting for L2."),
    "negative_cache_hits": (
        "kvserver_l2_negative_cache_hits",
        "counter",
        "L2 presence checks answered by the negative cache (no round trip).",
    ),
}
# describe()["l2_queue"]["admission"] key -> (metric name, help)
_L2_ADMISSION = {
    "admitted": ("kvserver_l2_admitted", "Committed objects passed on to L2 write-behind."),
    "deferred": ("kvserver_l2_admission_deferred", "Committed objects held back until a second use."),
    "forgotten": ("kvserver_l2_admission_forgotten", "Held-back objects never written (evicted first)."),
    "demoted": ("kvserver_l2_demoted", "Objects L1 evicted and queued for L2 (--l2-admission evicted*)."),
    "free_drops": ("kvserver_l2_free_drops", "Objects L1 evicted that L2 already held: dropped without a write."),
    "refused": ("kvserver_l2_refused", "Demotions refused: no room in L2 without cutting their own prefix."),
}


@dataclass(frozen=True)
class TierStats:
    tier: str
    objects: float | None = None
    used_bytes: float | None = None
    store_bytes: float | None = None
    retrieve_bytes: float | None = None
    evictions: float | None = None
    hits: float | None = None
    misses: float | None = None
    errors: float | None = None
    corrupt: float | None = None
    dropped: float | None = None
    retried: float | None = None
    up: float | None = None


def _number(entry: Mapping[str, Any], names: tuple[str, ...]) -> float | None:
    for name in names:
        value = entry.get(name)
        if isinstance(value, int | float):
            return float(value)  # bools (the "up" flag) become 1.0 / 0.0
    return None


def tier_stats(described: Mapping[str, Any]) -> list[TierStats]:
    """Per-tier numbers from a describe() map: L1 always, then one entry per L2 tier it reports."""
    l1, counters = described["l1"], described["counters"]
    tiers = [
        TierStats(
            "l1",
            l1["objects"],
            l1["used_bytes"],
            counters["stored_bytes"],
            counters["retrieved_bytes"],
            l1["evictions"],
        )
    ]
    seen = {"l1"}
    l2 = described.get("l2")
    for i, entry in enumerate(l2 if isinstance(l2, list) else []):
        if not isinstance(entry, Mapping):
            continue
        name = entry["tier"] if isinstance(entry.get("tier"), str) else ""
        label = name if _TIER_RE.match(name) and name not in seen else f"l2.{i}"
        seen.add(label)
        tiers.append(TierStats(label, **{field: _number(entry, (key,)) for field, key in _L2_KEYS.items()}))
    return tiers


def _per_tier(metric: CounterMetricFamily | GaugeMetricFamily, tiers: list[TierStats], field: str) -> Metric:
    for t in tiers:
        value = getattr(t, field)
        if value is not None:
            metric.add_metric([t.tier], value)
    return metric


class ServerCollector(Collector):
    """Reads one describe() per scrape and turns it into metric families."""

    def __init__(self, server: AdminBackend) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        d = self.server.describe()
        c, l1 = d["counters"], d["l1"]
        tiers = tier_stats(d)
        yield InfoMetricFamily("kvserver_build", "kvserver build", value={"version": str(d["version"])})
        yield CounterMetricFamily("kvserver_lookup_requests", "Lookups served.", value=c["lookups"])
        yield CounterMetricFamily("kvserver_lookup_tokens", "Tokens asked about by lookups.", value=c["lookup_tokens"])
        yield CounterMetricFamily(
            "kvserver_lookup_hit_tokens", "Tokens lookups found reusable (prefix hits).", value=c["lookup_hit_tokens"]
        )
        yield _per_tier(
            CounterMetricFamily("kvserver_store_bytes", "Bytes stored, per tier.", labels=["tier"]),
            tiers,
            "store_bytes",
        )
        yield _per_tier(
            CounterMetricFamily("kvserver_retrieve_bytes", "Bytes retrieved, per tier.", labels=["tier"]),
            tiers,
            "retrieve_bytes",
        )
        yield _per_tier(
            GaugeMetricFamily("kvserver_objects", "Ready objects held, per tier.", labels=["tier"]), tiers, "objects"
        )
        yield _per_tier(
            GaugeMetricFamily("kvserver_tier_used_bytes", "Bytes held, per tier.", labels=["tier"]), tiers, "used_bytes"
        )
        yield _per_tier(
            CounterMetricFamily("kvserver_evictions", "Objects evicted, per tier.", labels=["tier"]), tiers, "evictions"
        )
        yield GaugeMetricFamily("kvserver_l1_capacity_bytes", "L1 arena size.", value=l1["capacity_bytes"])
        yield GaugeMetricFamily(
            "kvserver_leases_active", "Objects held by at least one read lease.", value=l1["leased"]
        )
        yield GaugeMetricFamily("kvserver_pinned_objects", "Objects pinned in L1.", value=l1["pinned"])
        yield GaugeMetricFamily("kvserver_sessions_active", "Live lookup sessions.", value=d["sessions"])
        yield GaugeMetricFamily(
            "kvserver_stores_in_flight", "Reserved stores not yet committed.", value=d["stores_in_flight"]
        )
        yield GaugeMetricFamily("kvserver_engines", "Registered engine ranks.", value=len(d["engines"]))
        yield GaugeMetricFamily("kvserver_uptime_seconds", "Seconds since the server started.", value=d["uptime_s"])
        yield CounterMetricFamily(
            "kvserver_store_dedup_objects",
            "Store requests for objects already present.",
            value=c["deduplicated_objects"],
        )
        yield CounterMetricFamily(
            "kvserver_no_space", "Object reservations refused because L1 was full.", value=c["no_space"]
        )
        ann = d["announcements"]
        yield CounterMetricFamily(
            "kvserver_announced_chunks",
            "Chunks engines announced they were computing (claims taken or renewed).",
            value=ann["announced"],
        )
        yield CounterMetricFamily(
            "kvserver_announcement_waits",
            "Lookups answered inflight because another session announced the chunk they stop at.",
            value=ann["waits"],
        )
        corrupt = CounterMetricFamily(
            "kvserver_corrupt_reports",
            "Objects readers reported failing their kvsum64, by what the server's own check found "
            "(damaged: dropped from L1 and L2; intact: kept).",
            labels=["found"],
        )
        corrupt.add_metric(["damaged"], c["corrupt_dropped"])
        corrupt.add_metric(["intact"], c["corrupt_refuted"])
        yield corrupt
        yield CounterMetricFamily(
            "kvserver_lookup_tail_hits",
            "Lookups whose hit ended in a stored tail: the KV of a partial last chunk (docs/protocol.md).",
            value=c["lookup_tail_hits"],
        )
        yield CounterMetricFamily(
            "kvserver_stored_tails", "Stores that carried a tail (a partial last chunk).", value=c["stored_tails"]
        )
        yield CounterMetricFamily(
            "kvserver_broken_reads",
            "Reader releases whose leases had ended before the copy finished (the copy was discarded).",
            value=c["broken_reads"],
        )
        yield GaugeMetricFamily(
            "kvserver_quarantined_bytes",
            "L1 bytes of abandoned write slots held back for one lease TTL.",
            value=l1["quarantined_bytes"],
        )
        memo = d["hash_memo"]
        yield CounterMetricFamily(
            "kvserver_hash_chunks",
            "Chunk hashes requests needed (every full chunk of every request that names tokens).",
            value=memo["hits"] + memo["misses"],
        )
        yield CounterMetricFamily(
            "kvserver_hash_memo_hit_chunks",
            "Chunk hashes the memo of recently hashed chunks answered (not hashed again).",
            value=memo["hits"],
        )
        errors = CounterMetricFamily("kvserver_errors", "Error replies, by error code.", labels=["code"])
        # Every code from zero, so rate() and alerts see a series before the first error of a kind.
        for code in sorted({*map(str, ErrorCode), *d["errors"]}):
            errors.add_metric([code], d["errors"].get(code, 0))
        yield errors
        yield from _l2_families(tiers, d.get("l2_queue"))
        yield from _tenant_families(d.get("tenants") or {})
        yield from ec_families(d.get("ec"))
        yield from _blend_families(d.get("blend"))


_BLEND = {  # describe()["blend"] key -> (metric, kind, help); never folded into the prefix series above
    "lookups": ("kvserver_blend_lookup_requests", "counter", "Blend lookups served (CacheBlend, opt-in)."),
    "lookup_tokens": ("kvserver_blend_lookup_tokens", "counter", "Prompt tokens of blend lookups."),
    "hit_tokens": (
        "kvserver_blend_hit_tokens",
        "counter",
        "Tokens blend lookups found as content chunks at any position (approximate reuse).",
    ),
    "stored_bytes": ("kvserver_blend_store_bytes", "counter", "Bytes of blend chunks committed to L1."),
    "index_entries": ("kvserver_blend_index_entries", "gauge", "Content fingerprints findable by blend lookups."),
}


def _blend_families(blend: Any) -> Iterator[Metric]:
    if isinstance(blend, Mapping):
        for key, (name, kind, help_text) in _BLEND.items():
            value = _number(blend, (key,))
            if value is not None:
                family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                yield family(name, help_text, value=value)


_TENANT_SERIES = (  # describe key, metric name, kind, help; label `tenant` (operator-chosen names, at most 64)
    ("l1_used_bytes", "kvserver_tenant_l1_used_bytes", "gauge", "L1 bytes a tenant holds (reserved or ready)."),
    ("l1_quota_bytes", "kvserver_tenant_l1_quota_bytes", "gauge", "A tenant's L1 quota (absent: none)."),
    ("sessions", "kvserver_tenant_sessions_active", "gauge", "Live lookup sessions of a tenant."),
    ("stores_in_flight", "kvserver_tenant_stores_in_flight", "gauge", "Reserved stores of a tenant."),
    ("lookups", "kvserver_tenant_lookup_requests", "counter", "Lookups served, per tenant."),
    ("lookup_tokens", "kvserver_tenant_lookup_tokens", "counter", "Tokens asked about by lookups, per tenant."),
    ("lookup_hit_tokens", "kvserver_tenant_lookup_hit_tokens", "counter", "Prefix-hit tokens, per tenant."),
    ("stored_bytes", "kvserver_tenant_store_bytes", "counter", "Bytes committed to L1, per tenant."),
    ("retrieved_bytes", "kvserver_tenant_retrieve_bytes", "counter", "Bytes retrieved from L1, per tenant."),
    (
        "quota_evictions",
        "kvserver_tenant_quota_evictions",
        "counter",
        "Own objects evicted to stay within the tenant's L1 quota.",
    ),
    (
        "quota_refusals",
        "kvserver_tenant_quota_refusals",
        "counter",
        "Object reservations refused at the tenant's L1 quota.",
    ),
    ("refused_sessions", "kvserver_tenant_refused_sessions", "counter", "Lookups refused at the session cap."),
    ("refused_stores", "kvserver_tenant_refused_stores", "counter", "Stores refused at the reservation cap."),
    (
        "session_objects",
        "kvserver_tenant_session_objects",
        "gauge",
        "Chunk hashes and leased keys a tenant's sessions hold.",
    ),
    (
        "reserved_bytes",
        "kvserver_tenant_reserved_bytes",
        "gauge",
        "L1 bytes a tenant's whole-request reservations book.",
    ),
    (
        "refused_session_objects",
        "kvserver_tenant_refused_session_objects",
        "counter",
        "Lookups refused at the tenant's share of the session-object budget.",
    ),
    (
        "refused_reservations",
        "kvserver_tenant_refused_reservations",
        "counter",
        "Whole-request reservations refused at the tenant's booking cap.",
    ),
    (
        "ec_used_bytes",
        "kvserver_tenant_ec_used_bytes",
        "gauge",
        "Encoder-cache bytes a tenant holds (reserved, ready or quarantined).",
    ),
    ("ec_quota_bytes", "kvserver_tenant_ec_quota_bytes", "gauge", "A tenant's encoder-cache quota (absent: none)."),
    ("ec_leases", "kvserver_tenant_ec_leases_active", "gauge", "Live encoder-cache read leases of a tenant."),
    (
        "ec_fair_share_evictions",
        "kvserver_tenant_ec_fair_share_evictions",
        "counter",
        "A tenant's EC objects evicted for another tenant while it held more than its fair share.",
    ),
)


def _tenant_families(tenants: Mapping[str, Any]) -> Iterator[Metric]:
    for key, name, kind, help_text in _TENANT_SERIES:
        family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, help_text, labels=["tenant"])
        for tenant, row in tenants.items():
            value = row.get(key) if isinstance(row, Mapping) else None
            if isinstance(value, int | float) and not isinstance(value, bool):
                family.add_metric([str(tenant)], value)
        yield family


def _l2_families(tiers: list[TierStats], queue: Any) -> Iterator[Metric]:
    """L2-only series; absent (not zero) on a server without L2 tiers."""
    if len(tiers) > 1:
        for field, help_text in (
            ("hits", "Objects loaded from an L2 tier into L1."),
            ("misses", "Objects asked of an L2 tier and absent."),
            ("errors", "Failed L2 operations (each a batch)."),
            ("corrupt", "L2 objects that failed their integrity check (served as misses)."),
            ("dropped", "Writes to an L2 tier not done (queue full or retry set full)."),
            ("retried", "Writes missed while an L2 tier was down, queued again."),
        ):
            name = "kvserver_l2_dropped_writes" if field == "dropped" else f"kvserver_l2_{field}"
            yield _per_tier(CounterMetricFamily(name, help_text, labels=["tier"]), tiers, field)
        yield _per_tier(
            GaugeMetricFamily("kvserver_l2_up", "1 while an L2 tier answers, 0 while it is skipped.", labels=["tier"]),
            tiers,
            "up",
        )
    if isinstance(queue, Mapping):
        for key, (name, kind, help_text) in _L2_QUEUE.items():
            value = _number(queue, (key,))
            if value is not None:
                family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                yield family(name, help_text, value=value)
        admission = queue.get("admission")
        if isinstance(admission, Mapping):
            for key, (name, help_text) in _L2_ADMISSION.items():
                value = _number(admission, (key,))
                if value is not None:
                    yield CounterMetricFamily(name, help_text, value=value)


class ServerMetrics:
    """The registry of one server: scrape-time collector, latency histogram and HTTP counters."""

    def __init__(self, server: AdminBackend) -> None:
        disable_created_metrics()  # *_created series only add noise here (process-wide switch)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ServerCollector(server))
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        self.request_seconds = Histogram(
            "kvserver_request_duration_seconds",
            "Control-plane request latency, by op.",
            ["op"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.http_requests = Counter(
            "kvserver_http_requests",
            "Admin API requests, by route and status.",
            ["route", "status"],
            registry=self.registry,
        )
        server.observers.append(self.observe)

    def observe(self, op: str, seconds: float, _code: str | None) -> None:
        self.request_seconds.labels(op).observe(seconds)
