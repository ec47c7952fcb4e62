"""Admission of every store, prefix and blend alike: the one place that says what a store may take.

A store is asked, in order: are its layouts registered (object sizes); may its tenant open another
store (the server's and the tenant's caps); then, object by object: is the key already there
(`present` / `writing`), does the object fit outside other producers' bookings (reservation
headroom), within the tenant's L1 quota (its own objects evicted first), and in the arena. The
prefix path (writes.py) and CacheBlend (blend_index.py) both go through here, so a cap, a quota
or a booking binds every way bytes enter L1, and the two paths cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable

from kvprotocol import KeySpace, ObjectKey

from ..errors import LayoutMismatch, TooMany
from ..l1.cache import Entry, L1Cache, State
from .ledger import TenantLedger
from .reservations import ReservationBook
from .sessions import SessionTable
from ..security.tenants import Identity

MAX_STORES = 4096  # store transactions in flight per server, all tenants and kinds together


def _never() -> bool:
    return False


def _nothing() -> None:
    return None


class ObjectAdmission:
    """One store's objects, one at a time; the reservation headroom is drawn down as they are taken."""

    def __init__(self, l1: L1Cache, ledger: TenantLedger, who: Identity, budget: int | None) -> None:
        self.l1, self.ledger, self.who = l1, ledger, who
        self.budget = budget  # bytes this store may take without eating into bookings (None: no limit)

    def take(self, key: ObjectKey, size: int, parent: bytes | None = None) -> Entry | str:
        """A WRITING slot for `key`, or why not: "present", "writing" (another writer has it) or
        "no_space" (bookings, the tenant's quota or the arena)."""
        existing = self.l1.entries.get(key)
        if existing is not None:
            return "present" if existing.state is State.READY else "writing"
        if self.budget is not None:
            self.budget -= self.l1.alloc.slot_size(size)
            if self.budget < 0:
                return "no_space"
        if not self.ledger.make_room(self.who, size):
            return "no_space"
        entry = self.l1.reserve(key, size, parent)
        return "no_space" if entry is None else entry


class StoreAdmission:
    """The store caps, layout sizes and per-object admission shared by every kind of store."""

    def __init__(
        self,
        l1: L1Cache,
        table: SessionTable,
        ledger: TenantLedger,
        reservations: ReservationBook,
        object_sizes: dict[str, int],
        expire: Callable[[], None],
    ) -> None:
        self.l1, self.table, self.ledger, self.reservations = l1, table, ledger, reservations
        self.object_sizes = object_sizes  # layout fingerprint -> object bytes (register_engine fills it)
        self.expire = expire

    def sizes(self, ks: KeySpace) -> list[int]:
        """Object bytes per group of the keyspace; LAYOUT_MISMATCH for a layout no engine registered."""
        sizes = []
        for fp in ks[2]:
            size = self.object_sizes.get(fp)
            if size is None:
                raise LayoutMismatch(f"layout {fp} is not registered by any engine")
            sizes.append(size)
        return sizes

    def open(self, who: Identity, full: Callable[[], bool] = _never, sweep: Callable[[], None] = _nothing) -> None:
        """Refuse a new store past the server's store cap, or `full` (a caller's own bound, made
        good by `sweep`), after sweeping what expired; then past the tenant's own store cap."""
        if len(self.table.stores) >= MAX_STORES or full():
            self.expire()
            sweep()
        if len(self.table.stores) >= MAX_STORES or full():
            raise TooMany(f"{MAX_STORES} stores are in flight; commit or abort some first")
        self.ledger.admit_store(who)

    def objects(self, who: Identity, booked: bool = False) -> ObjectAdmission:
        """Admission of one store's objects. A store drawing on its own booking (`booked`) takes
        from that; any other store only from what the live bookings leave free."""
        book = self.reservations
        budget = book.headroom() if not booked and book.live else None
        return ObjectAdmission(self.l1, self.ledger, who, budget)


__all__ = ["MAX_STORES", "ObjectAdmission", "StoreAdmission"]
