"""What `describe` answers to the server's own token: config, L1, engines, sessions, counters, tenants, tiers.

One function over the running server, so the ZMQ op, the HTTP /v1/describe and the Prometheus
scrape (http/metrics.py) all read the same numbers. The ZMQ op answers it as a DescribeReply built
from those keywords, so a key the document gains and the reply Struct lacks fails loudly (in tests).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import kvprotocol
from kvprotocol._replies import DescribeReply

from ..l1.cache import State
from ..security.tenants import DEFAULT

if TYPE_CHECKING:
    from .server import KVServer
    from ..security.tenants import Identity


def describe_server(server: KVServer) -> dict[str, Any]:
    l1, c = server.l1, server.cache
    return {
        "version": kvprotocol.__version__,
        "protocol": kvprotocol.PROTOCOL_VERSION,
        "uptime_s": round(time.time() - server.started, 3),
        "config": server.config.public(),
        "l1": {
            "capacity_bytes": server.arena.capacity,
            "used_bytes": l1.used_bytes,
            "objects": l1.count(State.READY),
            "writing": l1.count(State.WRITING),
            "leased": l1.leased_objects(),
            "pinned": l1.pinned_objects(),
            "evictions": l1.evictions,
            "quarantined": l1.quarantined_slots,
            "quarantined_bytes": l1.quarantined_bytes,
            "arena": server.arena.name,
        },
        "warm_restart": server.warm.describe() if server.warm is not None else None,
        "engines": [vars(e) for e in c.engines.values()],
        "engines_expired": c.engine_table.expired,
        "layouts": c.layouts.describe(),
        "sessions": len(c.table.sessions),
        "stores_in_flight": len(c.table.stores),
        "counters": vars(c.counters),
        "hash_memo": c.hash_memo.describe(),
        "reservations": c.reservations.describe(),
        "announcements": c.announcements.describe(),
        "tenants": tenant_rows(server, None),
        "ec": server.ec.describe(),
        "blend": server.blend.describe(),  # CacheBlend hits are not prefix hits: never summed with counters
        "errors": dict(server.errors),
        "ops": dict(server.op_counts),
        "latency": server.latency.describe(),
        **({"l2": server.l2.describe(), "l2_queue": server.l2.describe_queue()} if server.l2 is not None else {}),
        **({"kv_events": server.kv_events.describe()} if server.kv_events is not None else {}),
    }


def describe_reply(server: KVServer) -> DescribeReply:
    """describe_server as the ZMQ reply Struct."""
    return DescribeReply(**describe_server(server))


def fleet_stats(server: KVServer) -> dict[str, Any]:
    """A heartbeat's body for the fleet coordinator (http/fleet.py): cheap, sent every few seconds."""
    l1 = server.l1
    out = {
        "models": sorted({e.model for e in server.cache.engines.values()})[:64],
        "l1_used_bytes": l1.used_bytes,
        "objects": len(l1.entries),
    }
    if server.kv_events is not None:  # lets the coordinator notice a lost tail of the stream
        out["kv_events_seq"] = server.kv_events.publisher.next_seq
    return out


def describe_tenant(server: KVServer, who: Identity) -> DescribeReply:
    """What a tenant's token may see of describe: the server's identity and its own tenant only."""
    return DescribeReply(
        version=kvprotocol.__version__,
        protocol=kvprotocol.PROTOCOL_VERSION,
        uptime_s=round(time.time() - server.started, 3),
        chunk_size=server.config.chunk_size,
        tenant=who.tenant,
        tenants=tenant_rows(server, who.tenant),
    )


def tenant_rows(server: KVServer, only: str | None) -> dict[str, dict[str, Any]]:
    """Per-tenant usage: the KV ledger's row (ledger.py), the encoder cache's `ec_*` fields (ec_tenants.py)
    and whether the tenant may use shm mode (the server's own token always may)."""
    rows = server.cache.ledger.usage(only)
    if only is None:  # tenants active only in the encoder cache get a row too
        for name in server.ec.tenants.usage.keys() - rows.keys():
            rows[name] = server.cache.ledger.usage(name)[name]
        rows = dict(sorted(rows.items()))
    for name, row in rows.items():
        row.update(server.ec.tenants.describe(name))
        row["allow_shm"] = name == DEFAULT or server.auth.tenants.get(name).allow_shm
    return rows
