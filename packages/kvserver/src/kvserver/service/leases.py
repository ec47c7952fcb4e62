"""Read leases per session and reader rank, and quarantine of abandoned write slots.

Why a module of its own: these are the rules that keep a slot's bytes from ever being handed out
under another object's name, and they are easiest to check in one place:

* A reader (one rank of one session) holds a lease on each of its objects from lookup until its
  own release, the session's expiry, a lookup that replaces it, or end_session. Eviction never
  takes a leased object, so while a reader's leases are held its slots cannot be reused.
* `release(session, rank, lease)` tells the reader whether the leases of the incarnation it
  retrieved under (its `lease` number) were still held when it released, i.e. whether they were
  held for the whole copy. If not, the copy may contain another object's bytes and must be
  thrown away (the engine recomputes).
* A reservation that ends without a commit while a writer might still be copying into it
  (expired or aborted, shm mode) keeps its slot out of use for one lease TTL; a writer stalled
  longer than that is dealt with when it speaks again (late_writers.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from kvprotocol import KeySpace, ObjectKey
from kvprotocol._replies import ReleaseReply

from ..errors import NotLeased, OutOfRange, UnknownSession
from ..l1.cache import L1Cache
from .late_writers import LateWriters
from .sessions import Reader, Session, SessionTable, StoreTxn


def shown(session_id: str) -> str:
    """A scoped session id (tenant NUL id, see tenants.Identity.scope) as its owner named it."""
    return session_id.split("\x00", 1)[-1]


def owner(session_id: str) -> str:
    """The tenant of a scoped session id (tenant NUL id)."""
    tenant, sep, _ = session_id.partition("\x00")
    return tenant if sep else "default"


def rank_keys(ks: KeySpace, salt: str, rank: int, hashes: list[bytes]) -> list[ObjectKey]:
    """The objects of one rank, every group, for the given chunk hashes, in chunk order."""
    model, world, groups = ks
    return [
        tuple.__new__(ObjectKey, (model, fp, world, rank, g, salt, h))  # hot: see ObjectKey
        for h in hashes
        for g, fp in enumerate(groups)
    ]


class Leases:
    def __init__(self, l1: L1Cache, table: SessionTable) -> None:
        self.l1 = l1
        self.table = table
        self.objects = 0  # chunk hashes + leased keys held by live readers (bounded by the cache's cap)
        self.by_tenant: dict[str, int] = {}  # the same, per tenant (bounded by its share)
        self.late = LateWriters(l1)  # writers that may copy past their quarantine

    def held(self, tenant: str) -> int:
        return self.by_tenant.get(tenant, 0)

    # -- readers -------------------------------------------------------------------------------
    def take(
        self,
        session_id: str,
        ks: KeySpace,
        salt: str,
        hashes: list[bytes],
        hit: int,
        rank: int | None,
        keys_of: Callable[[int], list[ObjectKey]] | None = None,
    ) -> None:
        """Lease the hit prefix to the session: for every rank (replacing the whole session), or for
        one rank (replacing only that rank's reader). Runs in one event-loop step, so an object that
        is unleased and leased again here can never be evicted in between. `keys_of(rank)`: the
        objects a rank needs when the keyspace has a geometry (groups.KeyPlan.needed); a shared
        object is leased once per reader, like any other. A reader keeps only the hashes of its hit:
        the chunks a lookup missed hold nothing."""
        session = self.table.sessions.get(session_id)
        if rank is None or session is None:
            self.drop(session_id)
            session = Session(session_id, {}, self.table.deadline())
            self.table.sessions[session_id] = session
        else:
            old = session.readers.pop(rank, None)
            if old is not None:
                self._end_reader(old)
        lease, tenant, hit_hashes = self.l1.lease, owner(session_id), hashes[:hit]
        for r in range(ks[1]) if rank is None else (rank,):
            keys = rank_keys(ks, salt, r, hit_hashes) if keys_of is None else keys_of(r)
            for key in keys:
                lease(key)
            reader = session.readers[r] = Reader(ks, salt, hit_hashes, hit, keys, tenant=tenant)
            if reader.charge:
                self.objects += reader.charge
                self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + reader.charge
        session.expires = self.table.deadline()

    def reader(self, session_id: str, rank: int) -> Reader:
        """The live reader of one rank (retrieve); refreshes the session's deadline."""
        session = self.table.sessions.get(session_id)
        if session is None:
            raise UnknownSession(f"no live session {shown(session_id)!r} (lookup first)")
        reader = session.readers.get(rank)
        if reader is None:
            world = next(iter(session.readers.values())).keyspace[1]
            if rank >= world:
                raise OutOfRange("rank must be < world_size")
            raise NotLeased(f"rank {rank} holds no leases in session {shown(session_id)!r} (released; lookup again)")
        session.expires = self.table.deadline()
        return reader

    def release(self, session_id: str, rank: int | None, lease: int | None) -> ReleaseReply:
        """Give back one rank's leases (or, without a rank, the whole session's).

        `intact` is true when the leases released are the ones the caller holds: with `lease`, the
        rank's reader is still the incarnation with that number. A mismatched number releases
        nothing (the current reader belongs to a later lookup).
        """
        session = self.table.sessions.get(session_id)
        if session is None:
            return ReleaseReply(released=False, intact=False)
        if rank is None:
            self.drop(session_id)
            return ReleaseReply(released=True, intact=True)
        reader = session.readers.get(rank)
        if reader is None or (lease is not None and reader.lease != lease):
            return ReleaseReply(released=False, intact=False)
        del session.readers[rank]
        self._end_reader(reader)
        if not session.readers:
            del self.table.sessions[session_id]
        return ReleaseReply(released=True, intact=True)

    def drop(self, session_id: str) -> bool:
        session = self.table.sessions.pop(session_id, None)
        if session is None:
            return False
        self._end(session)
        return True

    def _end(self, session: Session) -> None:
        for reader in session.readers.values():
            self._end_reader(reader)
        session.readers.clear()

    def _end_reader(self, reader: Reader) -> None:
        if reader.charge:  # a reader of a miss holds nothing, and was never counted
            self.objects -= reader.charge
            left = self.by_tenant[reader.tenant] - reader.charge
            if left:
                self.by_tenant[reader.tenant] = left
            else:
                del self.by_tenant[reader.tenant]
        unlease = self.l1.unlease
        for key in reader.keys:
            unlease(key)

    # -- writers -------------------------------------------------------------------------------
    def end_write(self, txn: StoreTxn, now: float | None = None) -> None:
        """A reservation ends without a commit. In shm mode the writer maps the arena and may still
        be copying (a stalled process, an asynchronous DMA): its slots are quarantined for one lease
        TTL instead of being handed to the next writer. In tcp mode the server writes the bytes
        itself at commit, so the slots are free at once."""
        if txn.mode == "tcp":
            for slot in txn.slots:
                self.l1.abort_write(slot.key)
            return
        until = (time.monotonic() if now is None else now) + self.table.lease_ttl
        for slot in txn.slots:
            self.l1.quarantine_write(slot.key, until)
        self.late.remember(txn)  # a writer stalled even longer is caught when it speaks again

    # -- expiry ----------------------------------------------------------------------------------
    def expire(self, now: float | None = None) -> tuple[int, int]:
        """End expired sessions and reservations, free finished quarantines; returns the counts."""
        now = time.monotonic() if now is None else now
        sessions, stores = self.table.expired(now)
        for s in sessions:
            self._end(s)
        for t in stores:
            self.end_write(t, now)
        self.l1.drain_quarantine(now)
        return len(sessions), len(stores)
