"""Prometheus series of the encoder cache (EC), apart from KV's: `kvserver_ec_*` (docs/metrics.md).

Read from describe()["ec"] at scrape time, like every other series of the server collector.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# describe()["ec"] key -> (metric name, help)
_GAUGES = {
    "capacity_bytes": ("kvserver_ec_capacity_bytes", "Encoder-cache budget (its own shm segment)."),
    "used_bytes": ("kvserver_ec_used_bytes", "Encoder-cache bytes allocated (ready and being written)."),
    "objects": ("kvserver_ec_objects", "Encoder outputs held, ready to read."),
    "object_bytes": ("kvserver_ec_object_bytes", "Bytes of the ready encoder outputs."),
    "leases": ("kvserver_ec_leases_active", "Live read leases on encoder outputs."),
}
# describe()["ec"]["counters"] key -> (metric name, help)
_COUNTERS = {
    "hits": ("kvserver_ec_hits", "Encoder outputs found by ec_lookup or ec_retrieve."),
    "misses": ("kvserver_ec_misses", "Encoder outputs asked for and absent."),
    "stores": ("kvserver_ec_stores", "Encoder outputs committed."),
    "stored_bytes": ("kvserver_ec_store_bytes", "Bytes of committed encoder outputs."),
    "retrieved_bytes": ("kvserver_ec_retrieve_bytes", "Bytes of encoder outputs retrieved."),
    "deduplicated": ("kvserver_ec_store_dedup", "Stores of encoder outputs already present."),
    "evictions": ("kvserver_ec_evictions", "Encoder outputs evicted (within the EC budget only)."),
    "evicted_bytes": ("kvserver_ec_evicted_bytes", "Bytes of evicted encoder outputs."),
    "no_space": ("kvserver_ec_no_space", "EC reservations refused: nothing evictable left."),
    "rejected_commits": ("kvserver_ec_rejected_commits", "tcp EC commits whose bytes failed their checksum."),
}


def ec_families(ec: Any) -> Iterator[Metric]:
    if not isinstance(ec, Mapping):
        return
    for key, (name, help_text) in _GAUGES.items():
        if isinstance(ec.get(key), int | float):
            yield GaugeMetricFamily(name, help_text, value=ec[key])
    counters = ec.get("counters")
    if isinstance(counters, Mapping):
        for key, (name, help_text) in _COUNTERS.items():
            if isinstance(counters.get(key), int | float):
                yield CounterMetricFamily(name, help_text, value=counters[key])
