"""The cache service: the one object the server's handlers call, composed of the state and its ops.

Handlers receive typed requests (kvprotocol._requests Structs, already checked) and return reply
Structs (kvprotocol._replies), which the server encodes as they are. The service holds no logic of
its own: the state (state.py), the key planner (keys.py), session admission and expiry
(session_admission.py), and the read (reads.py), write (writes.py) and registration (register.py)
operations, each built once over the same state; its op names are those operations' bound methods.
Everything runs on the server's single event-loop thread, so no locks are needed and no operation
ever waits on another.
May import: the service's own modules, `l1`, `security`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvprotocol._replies import ClearReply, EndSessionReply

from .after_reply import Defer
from .engines import Engine
from .keys import KeyPlanner
from ..l1.cache import L1Cache
from .reads import ReadOps
from .register import Registration
from ..security.tenants import ADMIN, Identity, TenantBook
from .state import CacheState
from .writes import WriteOps

if TYPE_CHECKING:
    from ..l2 import TierManager


class CacheService:
    """The cache ops the server dispatches to, and the collaborators other parts of the server wire up
    (hooks, the ledger and counters for describe, the engine table, the reservations' lifetime)."""

    def __init__(self, l1: L1Cache, chunk_size: int, lease_ttl: float, tenants: TenantBook | None = None) -> None:
        self.state = st = CacheState(l1, chunk_size, lease_ttl, tenants)
        self.keys = KeyPlanner(st)
        self.sessions = st.sessions  # session admission and the expiry sweep (CacheBlend's lookup too)
        self.reads = ReadOps(st, self.keys, st.sessions)
        self.writes = WriteOps(st, self.keys)
        self.registration = Registration(st)
        # what the rest of the server reads or wires (the same objects as the state's)
        self.l1, self.chunk_size, self.table, self.leases = l1, chunk_size, st.table, st.leases
        self.ledger, self.counters = st.ledger, st.counters
        self.reservations, self.admission, self.announcements = st.reservations, st.admission, st.announcements
        self.engine_table, self.layouts, self.hash_memo = st.engine_table, st.layouts, st.hash_memo
        self.on_commit, self.on_hit = st.hooks.commit, st.hooks.hit
        self.on_commit_txn, self.on_prefetched = st.hooks.commit_txn, st.hooks.prefetched
        self.expire = st.sessions.expire
        # the ops, bound once: a handler's call costs what a method call on one class costs
        self.register_engine = self.registration.register_engine
        self.lookup, self.lookup_l2, self.announce = self.reads.lookup, self.reads.lookup_l2, self.reads.announce
        self.query, self.query_l2, self.set_pinned = self.reads.query, self.reads.query_l2, self.reads.set_pinned
        self.retrieve, self.release = self.reads.retrieve, self.reads.release
        self.store, self.commit, self.abort = self.writes.store, self.writes.commit, self.writes.abort

    @property
    def l2(self) -> TierManager | None:
        """L2 prefetch on lookup misses (set by the server)."""
        return self.state.l2

    @l2.setter
    def l2(self, l2: TierManager | None) -> None:
        self.state.l2 = l2

    @property
    def defer(self) -> Defer:
        """What a reply need not wait for (the server sets its after-reply queue: after_reply.py)."""
        return self.state.defer

    @defer.setter
    def defer(self, defer: Defer) -> None:
        self.state.defer = defer

    @property
    def engines(self) -> dict[str, Engine]:
        """Registered engine ranks by id (describe, the fleet agent)."""
        return self.engine_table.engines

    def end_session(self, session: str, who: Identity = ADMIN) -> EndSessionReply:
        """Drop the session's leases, then abort its open stores."""
        session_id = who.scope(session)
        released = self.leases.drop(session_id)
        return EndSessionReply(released, self.writes.abort_session(session_id))

    def clear(self) -> ClearReply:
        return ClearReply(self.l1.clear())


__all__ = ["CacheService"]
