"""The table of registered engine ranks, kept for describe, the fleet agent and logs.

Why its own module: registration is bookkeeping beside the cache ops. A process that registers
again (a reconnect) keeps its id, and the table stays bounded so exited engines cannot grow it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("kvserver")
MAX_ENGINES = 256  # registrations kept; the oldest go first


@dataclass
class Engine:
    id: str
    model: str
    world_size: int
    rank: int
    groups: list[dict[str, Any]]
    host: str
    pid: int
    registered_at: float = field(default_factory=time.time)

    def same_process(self, other: Engine) -> bool:
        return bool(self.pid) and (self.model, self.world_size, self.rank, self.groups, self.host, self.pid) == (
            other.model, other.world_size, other.rank, other.groups, other.host, other.pid)


class EngineTable:
    def __init__(self, limit: int = MAX_ENGINES) -> None:
        self.limit = limit
        self.engines: dict[str, Engine] = {}

    def add(self, engine: Engine, fingerprints: list[str]) -> str:
        """Record a registration; returns its id (the earlier id when the same process registers again)."""
        again = next((old for old in self.engines.values() if engine.same_process(old)), None)
        if again is not None:
            del self.engines[again.id]
            engine.id = again.id
        self.engines[engine.id] = engine
        log.info("engine %s %s: model=%s rank=%d/%d host=%s pid=%d layouts=%s", engine.id,
                 "registered again" if again else "registered", engine.model, engine.rank, engine.world_size,
                 engine.host or "-", engine.pid, ",".join(fingerprints))
        while len(self.engines) > self.limit:
            del self.engines[next(iter(self.engines))]
        return engine.id
