"""The cache service's state: the collaborators every op works on, built once per server.

Owns nothing but their wiring (which one reads which one's figures); the ops (reads.py, writes.py,
register.py) and the key planner (keys.py) take this object and keep no state of their own.
Everything runs on the server's single event-loop thread, so no locks are needed.
May import: the service's own modules, `l1`, `security`, `l2` (types only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvprotocol import ZERO_HASH, KeySpace, ObjectKey

from .announcements import Announcements
from .admission import MAX_STORES, StoreAdmission
from .after_reply import Defer, run_now
from .engines import EngineTable
from .groups import GroupBook
from .hash_memo import HashMemo
from ..l1.cache import L1Cache
from ..l1.journal import TailMark
from .layouts import LayoutBook
from ..l2.background import BackgroundPrefetches
from .leases import Leases
from .ledger import Counters, TenantLedger
from .reservations import ReservationBook
from .session_admission import MAX_SESSION_OBJECTS, MAX_SESSIONS, SessionAdmission
from .sessions import SessionTable, StoreTxn
from .tails import TailIndex
from ..security.tenants import TenantBook, tenant_of_salt

if TYPE_CHECKING:
    from ..l2 import TierManager


class Hooks:
    """What other parts of the server run on cache events (L2, KV events, CacheBlend append here)."""

    __slots__ = ("commit", "commit_txn", "hit", "prefetched")

    def __init__(self) -> None:
        self.commit: list[Callable[[list[ObjectKey]], None]] = []  # e.g. L2 write-behind
        self.hit: list[Callable[[list[ObjectKey]], None]] = []  # objects a lookup hit (L2 admission)
        self.commit_txn: list[Callable[[StoreTxn], None]] = []  # e.g. KV events (need tokens, keyspace)
        # after an L2 prefetch: (keyspace, salt, tokens, chunk hashes, first chunk that missed before)
        self.prefetched: list[Callable[[KeySpace, str, bytes, list[bytes], int], None]] = []


class CacheState:
    """L1, the session table, leases, the tenant ledger, bookings, geometry, layouts, engines, counters
    and hooks of one server, wired to each other."""

    def __init__(self, l1: L1Cache, chunk_size: int, lease_ttl: float, tenants: TenantBook | None = None) -> None:
        self.l1 = l1
        self.chunk_size = chunk_size
        self.table = SessionTable(lease_ttl)
        self.ledger = TenantLedger(l1, self.table, tenants, (MAX_SESSIONS, MAX_STORES), MAX_SESSION_OBJECTS)
        self.leases = Leases(l1, self.table)
        self.ledger.held_objects = self.leases.held
        self.engine_table = EngineTable()
        self.groups = GroupBook(chunk_size)  # per-group geometry (sliding, state, shared, chunk sizes)
        self.layouts = LayoutBook(self.groups)  # bounded per tenant and in total
        self.object_sizes: dict[str, int] = self.layouts.sizes  # layout fingerprint -> object bytes
        self.counters = Counters()
        self.hooks = Hooks()
        self.l2: TierManager | None = None  # L2 prefetch on lookup misses (set by the server)
        self.background = BackgroundPrefetches()  # prefetches of lookups that did not wait
        self.reservations = ReservationBook(l1, lease_ttl)  # whole-request admission (kv_producer stores)
        self.reservations.cap_of = self.ledger.reservation_cap  # lifetime: set by the server (its config)
        self.reservations.on_refused = self.ledger.refuse_reservation
        self.announcements = Announcements()  # chunks engines are computing now (lookups say inflight)
        self.ledger.booked_bytes = self.reservations.booked
        # read sessions: the server's and each tenant's caps, and the sweep of whatever expired
        self.sessions = SessionAdmission(self.table, self.ledger, self.leases, self.reservations, self.counters)
        # what every store (prefix or blend) may take: caps, layout sizes, bookings, quota, arena
        self.admission = StoreAdmission(
            l1, self.table, self.ledger, self.reservations, self.object_sizes, self.sessions.expire
        )
        self.hash_memo = HashMemo()  # chunk hashes computed lately (the same prompt's lookup, then its saves)
        # the tail lengths stored after each chunk (what a lookup probes), shared fairly between tenants
        self.tails = TailIndex(owner=tenant_of_salt)
        l1.on_tail_adopted.append(self._tail_adopted)  # a warm restart's tails, as their bytes pass their check
        self.defer: Defer = run_now  # what a reply need not wait for (the server: after it; after_reply.py)

    def _tail_adopted(self, key: ObjectKey, mark: TailMark, parent: bytes | None) -> None:
        if not (key.group < len(mark.groups) and mark.groups[key.group] == key.layout_fingerprint):
            return  # a mark that does not fit its own key: the object stays, never found as a tail
        ks = KeySpace(key.model, key.world_size, tuple(mark.groups))
        self.tails.add((ks, key.salt, ZERO_HASH if parent is None else parent), mark.length)


__all__ = ["CacheState", "Hooks"]
