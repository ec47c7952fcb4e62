"""The cache service's state and the helpers its read and write paths share (keys, hashes, caps).

Split from cache.py so each file holds one job: this one (state, key helpers, session caps, expiry),
write_path.py (store, commit, abort), cache.py (engines, lookup, query, pin, retrieve, release).
Everything runs on the server's single event-loop thread, so no locks are needed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvprotocol import MAX_KEYS, KeySpace, ObjectKey
from kvprotocol._requests import KeysRequest

from .after_reply import Defer, run_now
from ..errors import OutOfRange, TooLarge, TooMany
from .engines import Engine, EngineTable
from .groups import GroupBook
from .hash_memo import HashMemo
from ..l1.cache import L1Cache, State
from .layouts import LayoutBook
from ..l2.background import BackgroundPrefetches
from .leases import Leases
from .sessions import SessionTable, StoreTxn
from .ledger import Counters, TenantLedger
from .reservations import ReservationBook
from .admission import MAX_STORES, StoreAdmission
from ..security.tenants import ADMIN, Identity, TenantBook

if TYPE_CHECKING:
    from ..l2 import TierManager


log = logging.getLogger("kvserver")


MAX_SESSIONS = 4096  # live read sessions per server, all tenants together (each tenant has its own cap too)
MAX_SESSION_OBJECTS = 1 << 22  # chunk hashes + leased keys all live sessions keep, in total


class CacheBase:
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
        self.on_commit: list[Callable[[list[ObjectKey]], None]] = []  # e.g. L2 write-behind
        self.on_hit: list[Callable[[list[ObjectKey]], None]] = []  # objects a lookup hit (L2 admission)
        self.on_commit_txn: list[Callable[[StoreTxn], None]] = []  # e.g. KV events (need tokens, keyspace)
        # after an L2 prefetch: (keyspace, salt, tokens, chunk hashes, first chunk that missed before)
        self.on_prefetched: list[Callable[[KeySpace, str, bytes, list[bytes], int], None]] = []
        self.l2: TierManager | None = None  # L2 prefetch on lookup misses (set by the server)
        self.background = BackgroundPrefetches()  # prefetches of lookups that did not wait
        self.reservations = ReservationBook(l1, lease_ttl)  # whole-request admission (kv_producer stores)
        self.reservations.cap_of = self.ledger.reservation_cap  # lifetime: set by the server (its config)
        self.reservations.on_refused = self.ledger.refuse_reservation
        self.ledger.booked_bytes = self.reservations.booked
        # what every store (prefix or blend) may take: caps, layout sizes, bookings, quota, arena
        self.admission = StoreAdmission(l1, self.table, self.ledger, self.reservations, self.object_sizes, self.expire)
        self.hash_memo = HashMemo()  # chunk hashes computed lately (the same prompt's lookup, then its saves)
        self.defer: Defer = run_now  # what a reply need not wait for (the server: after it; after_reply.py)

    @property
    def engines(self) -> dict[str, Engine]:
        """Registered engine ranks by id (describe, the fleet agent)."""
        return self.engine_table.engines

    # -- helpers -------------------------------------------------------------------------------
    @staticmethod
    def _ks(keyspace: dict[str, Any]) -> KeySpace:
        """A keyspace map (field-map handlers, e.g. blend_index.py) as the server's key tuple."""
        return KeySpace(keyspace["model"], keyspace["world_size"], tuple(keyspace["groups"]))

    def _chunk_keys(self, ks: KeySpace, salt: str, chunk_hash: bytes, c: int = -1) -> list[ObjectKey]:
        """Every (rank, group) object of one chunk (with a geometry: every object ending at unit c)."""
        plan = self.groups.plan(ks)
        if plan is not None:
            return plan.ending_at(salt, chunk_hash, c)
        model, world, groups = ks
        return [
            tuple.__new__(ObjectKey, (model, fp, world, rank, g, salt, chunk_hash))  # hot: see ObjectKey
            for rank in range(world)
            for g, fp in enumerate(groups)
        ]

    def _prefix_hits(
        self, ks: KeySpace, salt: str, hashes: list[bytes], hit_keys: list[list[ObjectKey]] | None = None
    ) -> int:
        """Largest k such that every (group, rank) object of chunks 0..k-1 is ready in L1.

        With `hit_keys` (a keyspace without a geometry), the keys of chunks 0..k-1 are appended to it,
        one list per chunk, so a lookup touches them without building them again.
        """
        plan = self.groups.plan(ks)
        if plan is not None:
            return plan.hit(salt, hashes, self.l1.ready)
        # the hot path of every lookup: plain loops over locals, no generators; l1.ready inlined
        entries, ready, new = self.l1.entries.get, State.READY, tuple.__new__
        model, world, groups = ks
        parts = [(model, fp, world, rank, g, salt) for rank in range(world) for g, fp in enumerate(groups)]
        for i, h in enumerate(hashes):
            keys = [new(ObjectKey, (*p, h)) for p in parts]  # see ObjectKey: built in C
            for key in keys:
                e = entries(key)
                if e is None or e.state is not ready:
                    return i
            if hit_keys is not None:
                hit_keys.append(keys)
        return len(hashes)

    def _hashes(self, f: KeysRequest, per_chunk: int, who: Identity) -> list[bytes]:
        """The request's chunk hashes, its per-chunk extra keys folded in (kvprotocol's one definition,
        remembered per key-space salt: hash_memo.py).

        Runs before a handler changes anything: a request naming more than MAX_KEYS objects is
        TOO_LARGE before any hashing, and an extra key beyond the last full chunk is OUT_OF_RANGE.
        """
        chunks = len(f.tokens) // 4 // self.chunk_size
        if chunks * per_chunk > MAX_KEYS:
            raise TooLarge(f"{chunks} chunks x {per_chunk} objects each is over {MAX_KEYS} objects per request")
        try:
            return self.hash_memo.hashes(who.salt(f.salt), f.tokens, self.chunk_size, f.extra or ())
        except IndexError as exc:
            raise OutOfRange(str(exc)) from None

    @staticmethod
    def _per_chunk(f: KeysRequest) -> int:
        return f.keyspace.per_chunk

    def _admit_session(self, session_id: str, objects: int, who: Identity = ADMIN) -> None:
        """Refuse a session past the per-server and per-tenant caps (after sweeping expired ones):
        a new session past the session counts, and `objects` more chunk hashes + leased keys (what
        its hit will hold; a miss holds nothing) past the server's budget or the tenant's share of it.
        A lookup replacing an existing session's leases is checked as if it kept them too."""
        new = session_id not in self.table.sessions
        if new:
            self.ledger.admit_session(who, self.expire)
            if len(self.table.sessions) >= MAX_SESSIONS:
                self.expire()
            if len(self.table.sessions) >= MAX_SESSIONS:
                raise TooMany(f"{MAX_SESSIONS} sessions are live; end some first")
        if not objects:
            return
        share = self.ledger.session_objects_cap(who.tenant)
        leases = self.leases
        if leases.objects + objects > MAX_SESSION_OBJECTS or leases.held(who.tenant) + objects > share:
            self.expire()
        if leases.held(who.tenant) + objects > share:
            self.ledger.counters(who).refused_session_objects += 1
            raise TooMany(f"tenant {who.tenant!r}'s sessions hold {share} objects at most; end some first")
        if leases.objects + objects > MAX_SESSION_OBJECTS:
            raise TooMany("live sessions hold too many objects; end some first")

    def expire(self, now: float | None = None) -> None:
        sessions, stores = self.leases.expire(now)  # first: a reservation's expired stores are no longer open
        for res in self.reservations.expired(time.monotonic() if now is None else now, self.table.stores.__contains__):
            self.reservations.rollback(res)  # its producer went quiet (died, gave up) or ran past its lifetime
        self.counters.expired_sessions += sessions
        self.counters.expired_stores += stores
        self.counters.late_write_dropped += self.leases.late.sweep()
