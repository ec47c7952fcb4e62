"""The cache service's counters: server-wide, and per tenant with its limits, caps and L1 quota.

Why its own module: the ops in cache.py only ask "may this tenant open a session / reserve this
much?" and "count this"; the rules (caps counted only when they can bind, quota met by evicting the
tenant's own objects first) live here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


from ..errors import TooMany
from ..l1.cache import L1Cache, tenant_of
from .sessions import SessionTable
from ..security.tenants import DEFAULT, RESERVATION_SHARE, Identity, TenantBook


@dataclass
class Counters:
    """Server-wide counters (describe `counters`, /metrics)."""

    lookups: int = 0
    lookup_tokens: int = 0
    lookup_hit_tokens: int = 0
    stores: int = 0
    stored_objects: int = 0
    stored_bytes: int = 0
    deduplicated_objects: int = 0
    no_space: int = 0
    retrieves: int = 0
    retrieved_bytes: int = 0
    expired_sessions: int = 0
    expired_stores: int = 0
    broken_reads: int = 0  # releases that found their leases gone: the reader's copy was thrown away
    late_commits: int = 0  # commits that arrived after their reservation's deadline
    late_write_dropped: int = 0  # objects a stalled shm writer overwrote once reused (late_writers.py)
    corrupt_reported: int = 0  # objects readers reported damaged (and not checked clean before)
    corrupt_dropped: int = 0  # of those, found damaged by the server's own kvsum64 and dropped
    corrupt_refuted: int = 0  # of those, found intact (kept)
    lookup_tail_hits: int = 0  # lookups whose hit ended in a stored tail (a partial last chunk, tails.py)
    stored_tails: int = 0  # stores that carried a tail


@dataclass
class TenantCounters:
    """What one tenant did: the per-tenant rows of describe and /metrics."""

    lookups: int = 0
    lookup_tokens: int = 0
    lookup_hit_tokens: int = 0
    stores: int = 0
    stored_objects: int = 0
    stored_bytes: int = 0
    retrieves: int = 0
    retrieved_bytes: int = 0
    quota_evictions: int = 0  # own objects evicted to make room within the tenant's L1 quota
    quota_refusals: int = 0  # object reservations refused because the tenant's quota was full
    refused_sessions: int = 0  # lookups refused at the tenant's session cap (TOO_MANY)
    refused_stores: int = 0  # stores refused at the tenant's reservation cap (TOO_MANY)
    refused_session_objects: int = 0  # lookups refused at the tenant's share of session objects (TOO_MANY)
    refused_reservations: int = 0  # reservations refused at the tenant's booking cap (RETRY_LATER, NO_SPACE)


class TenantLedger:
    def __init__(
        self,
        l1: L1Cache,
        table: SessionTable,
        book: TenantBook | None,
        server_caps: tuple[int, int],
        session_objects: int = 1 << 22,
    ) -> None:
        self.l1, self.table, self.book = l1, table, book
        self.server_caps = server_caps  # (sessions, stores): all a tenant without its own caps gets
        self.session_objects = session_objects  # the server's session-object budget: the default tenant's cap
        self.held_objects: Callable[[str], int] = lambda tenant: 0  # set by the cache service (leases.py)
        self.booked_bytes: Callable[[str], int] = lambda tenant: 0  # set by the cache service (reservations.py)
        self.by_tenant: dict[str, TenantCounters] = {}

    def counters(self, who: Identity) -> TenantCounters:
        c = self.by_tenant.get(who.tenant)
        if c is None:
            c = self.by_tenant[who.tenant] = TenantCounters()
        return c

    def limits(self, tenant: str) -> tuple[int | None, int, int]:
        """(L1 quota bytes or None, max sessions, max stores) of a tenant."""
        if self.book is None or tenant not in self.book.tenants:
            return None, *self.server_caps
        t = self.book.tenants[tenant]
        return t.l1_quota_bytes, t.max_sessions, t.max_stores

    def session_objects_cap(self, tenant: str) -> int:
        """Chunk hashes + leased keys a tenant's live sessions may hold: its share of the server's
        budget, so one tenant's sessions cannot leave another none."""
        if self.book is None or tenant not in self.book.tenants:
            return self.session_objects
        return min(self.book.tenants[tenant].max_session_objects, self.session_objects)

    def reservation_cap(self, tenant: str) -> int:
        """L1 bytes a tenant's live whole-request reservations may book together: its own cap, else
        1/RESERVATION_SHARE of L1, never more than its quota (the default tenant: all of L1)."""
        capacity = self.l1.alloc.capacity
        if self.book is None or tenant not in self.book.tenants:
            return capacity
        t = self.book.tenants[tenant]
        cap = t.max_reserved_bytes if t.max_reserved_bytes is not None else capacity // RESERVATION_SHARE
        return min(cap, capacity, capacity if t.l1_quota_bytes is None else t.l1_quota_bytes)

    def refuse_reservation(self, tenant: str) -> None:
        self.counters(Identity(tenant)).refused_reservations += 1

    def _sessions_of(self, who: Identity) -> int:
        prefix = who.scope("")
        return sum(1 for s in self.table.sessions if s.startswith(prefix))

    def admit_session(self, who: Identity, expire: Callable[[], None]) -> None:
        """Refuse a new session of a tenant at its cap (TOO_MANY), after sweeping expired ones.

        Counting the tenant's sessions is needed only when the table holds at least `cap` sessions."""
        cap = self.limits(who.tenant)[1]
        if len(self.table.sessions) < cap or self._sessions_of(who) < cap:
            return
        expire()
        if self._sessions_of(who) >= cap:
            self.counters(who).refused_sessions += 1
            raise TooMany(f"tenant {who.tenant!r} has {cap} live sessions; end some first")

    def admit_store(self, who: Identity) -> None:
        cap = self.limits(who.tenant)[2]
        if len(self.table.stores) >= cap and sum(1 for t in self.table.stores.values() if t.owner == who.tenant) >= cap:
            self.counters(who).refused_stores += 1
            raise TooMany(f"tenant {who.tenant!r} has {cap} stores in flight; commit or abort some first")

    def make_room(self, who: Identity, size: int) -> bool:
        """Room for `size` more L1 bytes within the tenant's quota, evicting its own objects first;
        False (counted as a quota refusal) when its own evictable objects do not free enough."""
        quota = self.limits(who.tenant)[0]
        if quota is None:
            return True
        tenant, used = who.tenant, self.l1.tenant_bytes
        while used.get(tenant, 0) + size > quota:
            if not self.l1.evict_one(lambda k: tenant_of(k) == tenant):
                self.counters(who).quota_refusals += 1
                return False
            self.counters(who).quota_evictions += 1
        return True

    def usage(self, only: str | None = None) -> dict[str, dict[str, Any]]:
        """Per-tenant usage, limits and counters: the configured tenants and any that has been active."""
        known = self.book.tenants if self.book is not None else {}
        names = {DEFAULT, *known, *self.by_tenant} if only is None else {only}
        out: dict[str, dict[str, Any]] = {}
        for name in sorted(names):
            quota, max_sessions, max_stores = self.limits(name)
            configured = name in known
            out[name] = {
                "l1_used_bytes": self.l1.tenant_bytes.get(name, 0),
                "l1_quota_bytes": quota,
                "sessions": self._sessions_of(Identity(name)),
                "stores_in_flight": sum(1 for t in self.table.stores.values() if t.owner == name),
                "max_sessions": max_sessions if configured else None,
                "max_stores": max_stores if configured else None,
                "session_objects": self.held_objects(name),
                "max_session_objects": self.session_objects_cap(name),
                "reserved_bytes": self.booked_bytes(name),
                "max_reserved_bytes": self.reservation_cap(name),
                **vars(self.by_tenant.get(name) or TenantCounters()),
            }
        return out
