"""Admission of read sessions and the sweep of whatever expired: the server's and each tenant's caps.

Why its own module: a prefix lookup and a blend lookup (blend_index.py) open sessions the same way,
so both ask here, and the store admission (admission.py) sweeps through the same `expire`.
May import: the service's own modules, `security`, `errors`.
"""

from __future__ import annotations

import time

from ..errors import TooMany
from .leases import Leases
from .ledger import Counters, TenantLedger
from .reservations import ReservationBook
from .sessions import SessionTable
from ..security.tenants import ADMIN, Identity

MAX_SESSIONS = 4096  # live read sessions per server, all tenants together (each tenant has its own cap too)
MAX_SESSION_OBJECTS = 1 << 22  # chunk hashes + leased keys all live sessions keep, in total


class SessionAdmission:
    """May this session open, may it hold this many more objects; and the expiry sweep."""

    def __init__(
        self,
        table: SessionTable,
        ledger: TenantLedger,
        leases: Leases,
        reservations: ReservationBook,
        counters: Counters,
    ) -> None:
        self.table, self.ledger, self.leases = table, ledger, leases
        self.reservations, self.counters = reservations, counters

    def admit(self, session_id: str, objects: int, who: Identity = ADMIN) -> None:
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
        """Sweep expired sessions and stores, reservations whose producer went quiet, late writers."""
        sessions, stores = self.leases.expire(now)  # first: a reservation's expired stores are no longer open
        for res in self.reservations.expired(time.monotonic() if now is None else now, self.table.stores.__contains__):
            self.reservations.rollback(res)  # its producer went quiet (died, gave up) or ran past its lifetime
        self.counters.expired_sessions += sessions
        self.counters.expired_stores += stores
        self.counters.late_write_dropped += self.leases.late.sweep()


__all__ = ["MAX_SESSIONS", "MAX_SESSION_OBJECTS", "SessionAdmission"]
