"""The table of registered engine ranks, kept for describe, the fleet agent and logs.

Why its own module: registration is bookkeeping beside the cache ops. A process that registers
again (a reconnect) keeps its id, and the table stays bounded so exited engines cannot grow it. The
table is shared by all tenants, so each tenant (but the server's own token) keeps at most
`per_tenant` entries, its own oldest going first; past the whole table's limit the oldest entry of
the tenant holding the most goes, so a tenant never pushes out another that holds fewer.

Registrations expire, so describe, `kvcli top` and the `kvserver_engines` gauge count engines that
exist: one whose process this server could see when it registered (same host name, its pid alive
then: the same pid namespace) goes at the first sweep after that process is gone, or its pid names
a younger process; any other (another host or container, no pid) goes once its keyspace has been
silent for `ttl` seconds (no lookup, store or other keyed request, no new registration).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import Counter
from dataclasses import dataclass, field

from kvprotocol._layout import LayoutWire

from ..security.tenants import DEFAULT

log = logging.getLogger("kvserver")
MAX_ENGINES = 256  # registrations kept, all tenants together
MAX_TENANT_ENGINES = 64  # registrations kept per tenant (the server's own token: only MAX_ENGINES)
ENGINE_TTL = 600.0  # default of --engine-ttl: silence after which a registration nobody can check goes
_HOST = socket.gethostname()


@dataclass
class Engine:
    id: str
    model: str
    world_size: int
    rank: int
    groups: list[LayoutWire]
    host: str
    pid: int
    registered_at: float = field(default_factory=time.time)
    tenant: str = DEFAULT  # who registered it: only the same tenant re-registers (or displaces) it

    def same_process(self, other: Engine) -> bool:
        return (
            bool(self.pid)
            and self.tenant == other.tenant
            and (self.model, self.world_size, self.rank, self.groups, self.host, self.pid)
            == (
                other.model,
                other.world_size,
                other.rank,
                other.groups,
                other.host,
                other.pid,
            )
        )


def process_gone(pid: int, since: float) -> bool:
    """True when no process `pid` exists here, or the one that does started after `since` (pid reuse)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OSError):  # exists, owned by someone else: it is alive
        pass
    try:
        with open(f"/proc/{pid}/stat") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as fh:
            boot = next(int(line.split()[1]) for line in fh if line.startswith("btime "))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK") > since + 1.0
    except (OSError, ValueError, IndexError, StopIteration):
        return False


class EngineTable:
    def __init__(self, limit: int = MAX_ENGINES, ttl: float = ENGINE_TTL, per_tenant: int = MAX_TENANT_ENGINES) -> None:
        self.limit = limit
        self.ttl = ttl
        self.per_tenant = per_tenant
        self.engines: dict[str, Engine] = {}
        self.layouts: dict[str, tuple[str, ...]] = {}  # id -> the layout fingerprints it registered
        self.seen: dict[tuple[str, int], float] = {}  # (model, world size) -> last keyed request (monotonic)
        self.visible: set[str] = set()  # ids whose process this server can check (see the module doc)
        self.expired = 0

    def add(self, engine: Engine, fingerprints: list[str]) -> str:
        """Record a registration; returns its id (the earlier id when the same process registers again)."""
        again = next((old for old in self.engines.values() if engine.same_process(old)), None)
        if again is not None:
            del self.engines[again.id]
            engine.id = again.id
        self.engines[engine.id] = engine
        self.layouts[engine.id] = tuple(fingerprints)
        self.visible.discard(engine.id)
        if engine.pid > 0 and engine.host == _HOST and not process_gone(engine.pid, engine.registered_at):
            self.visible.add(engine.id)
        self.touch(engine.model, engine.world_size)
        log.info(
            "engine %s %s: model=%s rank=%d/%d host=%s pid=%d layouts=%s",
            engine.id,
            "registered again" if again else "registered",
            engine.model,
            engine.rank,
            engine.world_size,
            engine.host or "-",
            engine.pid,
            ",".join(fingerprints),
        )
        self._bound(engine.tenant)
        return engine.id

    def _bound(self, tenant: str) -> None:
        """Drop the registering tenant's oldest past its share, then the largest holder's oldest."""
        if tenant != DEFAULT:
            mine = [e.id for e in self.engines.values() if e.tenant == tenant]
            for engine_id in mine[: max(0, len(mine) - self.per_tenant)]:
                self._drop(engine_id)
        while len(self.engines) > self.limit:
            held = Counter(e.tenant for e in self.engines.values())
            most = max(held.values())
            victim = tenant if held[tenant] == most else next(t for t, n in held.items() if n == most)
            self._drop(next(e.id for e in self.engines.values() if e.tenant == victim))

    def _drop(self, engine_id: str) -> None:
        del self.engines[engine_id]
        self.layouts.pop(engine_id, None)
        self.visible.discard(engine_id)

    def in_use(self, tenant: str | None = None) -> set[str]:
        """Layout fingerprints the registered engines (of one tenant; None: of all) use."""
        return {
            fp
            for engine_id, fps in self.layouts.items()
            if tenant is None or self.engines[engine_id].tenant == tenant
            for fp in fps
        }

    def touch(self, model: str, world_size: int, now: float | None = None) -> None:
        """A keyed request for this keyspace: its engines are alive (one dict store, on every request)."""
        self.seen[(model, world_size)] = time.monotonic() if now is None else now

    def expire(self, now: float | None = None) -> list[str]:
        """Drop registrations of exited local processes and of silent remote ones; returns their ids."""
        now = time.monotonic() if now is None else now
        gone = []
        for engine in list(self.engines.values()):
            if engine.id in self.visible:
                why = "process exited" if process_gone(engine.pid, engine.registered_at) else None
            elif now - self.seen.get((engine.model, engine.world_size), now) > self.ttl:
                why = f"silent for {self.ttl:g}s"
            else:
                why = None
            if why:
                self._drop(engine.id)
                gone.append(engine.id)
                log.info(
                    "engine %s expired (%s): model=%s rank=%d/%d host=%s pid=%d",
                    engine.id,
                    why,
                    engine.model,
                    engine.rank,
                    engine.world_size,
                    engine.host or "-",
                    engine.pid,
                )
        live = {(e.model, e.world_size) for e in self.engines.values()}
        for key in [k for k in self.seen if k not in live]:
            del self.seen[key]
        self.expired += len(gone)
        return gone
