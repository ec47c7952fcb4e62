"""Soft-state membership: instances live as long as they heartbeat, and nothing is persisted.

An instance that misses heartbeats for `timeout` seconds is dropped; one whose last heartbeat is
older than two of its own intervals is reported "late" meanwhile. A server that registers again
under the same ZMQ url (a restart) replaces its old entry, so a crashed server never shows twice.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_INSTANCES = 4096
log = logging.getLogger("kvcoordinator")
_DROP_WORDS = {
    "replaced": "replaced by a new registration of its url",
    "deregistrations": "deregistered",
    "timeouts": "timed out (no heartbeat)",
}


@dataclass
class Instance:
    id: str
    zmq_url: str
    http_url: str | None
    version: str
    l1_capacity_bytes: int
    heartbeat_interval: float
    chunk_size: int | None = None
    kv_events: Any = None  # models.KVEventsAd when the instance publishes KV events
    models: list[str] = field(default_factory=list)
    l1_used_bytes: int = 0
    objects: int = 0
    registered_at: float = field(default_factory=time.time)
    last_seen_wall: float = field(default_factory=time.time)
    last_seen: float = 0.0  # monotonic
    heartbeats: int = 0

    def update(self, stats: dict[str, Any]) -> None:
        for name in ("models", "l1_used_bytes", "objects"):
            if stats.get(name) is not None:
                setattr(self, name, stats[name])


class RegistryFull(Exception):
    pass


class Registry:
    def __init__(
        self, timeout: float, clock: Callable[[], float] = time.monotonic, max_instances: int = MAX_INSTANCES
    ) -> None:
        self.timeout = timeout
        self.clock = clock
        self.max_instances = max_instances
        self.instances: dict[str, Instance] = {}
        self.counts = {
            "registrations": 0,
            "heartbeats": 0,
            "unknown_heartbeats": 0,
            "deregistrations": 0,
            "timeouts": 0,
            "replaced": 0,
        }
        self.on_drop: list[Callable[[Instance, str], None]] = []

    def register(self, fields: dict[str, Any]) -> Instance:
        self.prune()
        for old in [i for i in self.instances.values() if i.zmq_url == fields["zmq_url"]]:
            self._drop(old, "replaced")
        if len(self.instances) >= self.max_instances:
            raise RegistryFull(f"registry holds {self.max_instances} instances already")
        stats: dict[str, Any] = {k: fields.pop(k) for k in ("models", "l1_used_bytes", "objects") if k in fields}
        inst = Instance(id=secrets.token_hex(8), **fields)
        inst.update(stats)
        inst.last_seen = self.clock()
        self.instances[inst.id] = inst
        self.counts["registrations"] += 1
        log.info(
            "instance %s registered: zmq=%s http=%s version=%s (%d instances)",
            inst.id,
            inst.zmq_url,
            inst.http_url,
            inst.version,
            len(self.instances),
        )
        return inst

    def heartbeat(self, instance_id: str, stats: dict[str, Any]) -> Instance | None:
        """Refresh an instance; None when it is unknown (the caller answers 404 so it re-registers)."""
        self.prune()
        inst = self.instances.get(instance_id)
        if inst is None:
            self.counts["unknown_heartbeats"] += 1
            return None
        inst.update(stats)
        inst.last_seen, inst.last_seen_wall = self.clock(), time.time()
        inst.heartbeats += 1
        self.counts["heartbeats"] += 1
        return inst

    def deregister(self, instance_id: str) -> bool:
        inst = self.instances.get(instance_id)
        if inst is None:
            return False
        self._drop(inst, "deregistrations")
        return True

    def prune(self) -> list[Instance]:
        """Drop every instance silent for longer than the timeout; returns them."""
        now = self.clock()
        dead = [i for i in self.instances.values() if now - i.last_seen > self.timeout]
        for inst in dead:
            self._drop(inst, "timeouts")
        return dead

    def liveness(self, inst: Instance) -> str:
        age = self.clock() - inst.last_seen
        return "live" if age <= max(2 * inst.heartbeat_interval, 1.0) else "late"

    def live(self) -> list[Instance]:
        self.prune()
        return sorted(self.instances.values(), key=lambda i: i.registered_at)

    def view(self, inst: Instance) -> dict[str, Any]:
        return {
            "id": inst.id,
            "zmq_url": inst.zmq_url,
            "http_url": inst.http_url,
            "version": inst.version,
            "models": list(inst.models),
            "chunk_size": inst.chunk_size,
            "l1_capacity_bytes": inst.l1_capacity_bytes,
            "l1_used_bytes": inst.l1_used_bytes,
            "objects": inst.objects,
            "registered_at": inst.registered_at,
            "last_seen": inst.last_seen_wall,
            "seconds_since_heartbeat": round(self.clock() - inst.last_seen, 3),
            "heartbeat_interval": inst.heartbeat_interval,
            "heartbeats": inst.heartbeats,
            "liveness": self.liveness(inst),
        }

    def _drop(self, inst: Instance, why: str) -> None:
        del self.instances[inst.id]
        self.counts[why] += 1
        log.info(
            "instance %s %s: zmq=%s, last heartbeat %.1fs ago (%d instances)",
            inst.id,
            _DROP_WORDS[why],
            inst.zmq_url,
            self.clock() - inst.last_seen,
            len(self.instances),
        )
        for hook in self.on_drop:
            hook(inst, why)


async def prune_forever(registry: Registry, period: float = 1.0) -> None:
    """Drop timed-out instances even while nobody registers or heartbeats (their index entries go with them)."""
    while True:
        await asyncio.sleep(period)
        registry.prune()
