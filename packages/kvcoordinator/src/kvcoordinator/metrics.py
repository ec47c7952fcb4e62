"""The coordinator's own metrics plus fleet gauges, on a private registry.

Membership numbers are read from the registry at scrape time; fleet usage comes from the last
heartbeats (no fan-out on scrape, so a scrape is cheap and never waits on a slow server). Labels
stay bounded: no instance ids (they change on every re-registration).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from .registry import Registry

PREFIX = "kvcoordinator"


class RegistryCollector(Collector):
    def __init__(self, registry: Registry, version: str) -> None:
        self.registry, self.version = registry, version

    def collect(self) -> Iterator[Metric]:
        reg = self.registry
        instances = reg.live()
        yield InfoMetricFamily(f"{PREFIX}_build", "coordinator build", value={"version": self.version})
        by_state = GaugeMetricFamily(f"{PREFIX}_instances", "Registered instances, by liveness.", labels=["liveness"])
        for state in ("live", "late"):
            by_state.add_metric([state], sum(1 for i in instances if reg.liveness(i) == state))
        yield by_state
        for name, key, text in (
            ("registrations", "registrations", "Registrations accepted."),
            ("heartbeats", "heartbeats", "Heartbeats accepted."),
            ("unknown_heartbeats", "unknown_heartbeats", "Heartbeats for unknown ids (answered 404)."),
            ("deregistrations", "deregistrations", "Instances that deregistered."),
            ("instance_timeouts", "timeouts", "Instances dropped after missing heartbeats."),
            ("instances_replaced", "replaced", "Entries replaced by a new registration of the same server."),
        ):
            yield CounterMetricFamily(f"{PREFIX}_{name}", text, value=reg.counts[key])
        yield GaugeMetricFamily(
            f"{PREFIX}_fleet_l1_capacity_bytes",
            "Sum of the instances' L1 capacity.",
            value=sum(i.l1_capacity_bytes for i in instances),
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_fleet_l1_used_bytes",
            "Sum of L1 bytes used, as last heartbeated.",
            value=sum(i.l1_used_bytes for i in instances),
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_fleet_objects",
            "Sum of L1 objects, as last heartbeated.",
            value=sum(i.objects for i in instances),
        )


class CoordinatorMetrics:
    def __init__(self, registry: Registry, version: str) -> None:
        disable_created_metrics()  # *_created series only add noise here (process-wide switch)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RegistryCollector(registry, version))
        self.fanout = Counter(
            f"{PREFIX}_fanout_requests",
            "Requests to instances, by endpoint and outcome.",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.lookups = Counter(f"{PREFIX}_fleet_lookups", "Fleet lookups answered.", registry=self.registry)
        self.lookup_tokens = Counter(
            f"{PREFIX}_fleet_lookup_tokens", "Tokens asked about by fleet lookups.", registry=self.registry
        )
        self.lookup_hit_tokens = Counter(
            f"{PREFIX}_fleet_lookup_hit_tokens",
            "Longest prefix found per fleet lookup, summed (tokens).",
            registry=self.registry,
        )

    def outcome(self, endpoint: str, outcome: str) -> None:
        self.fanout.labels(endpoint, outcome).inc()
