"""Write operations: store reserves slots, commit makes them readable atomically, abort gives them back.

Whole-request reservations (reservations.py) and tenant quotas are checked before anything changes,
through the one store admission (admission.py) that CacheBlend's stores use too.
May import: the service's own modules, `l1`, `security`, `errors`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvprotocol._replies import AbortReply, CommitReply, StoreReply, StoreSlot
from kvprotocol._requests import Store

from ..errors import BadField, Forbidden, OutOfRange, UnknownStore
from ..l1.journal import TailMark
from .keys import KeyPlanner
from .sessions import Slot, StoreTxn, new_store_id
from ..security.tenants import ADMIN, Identity

if TYPE_CHECKING:
    from .state import CacheState


class WriteOps:
    """store, commit, abort (and the aborts a rollback or an ended session asks for), over the state."""

    def __init__(self, state: CacheState, keys: KeyPlanner) -> None:
        self.l1, self.table, self.ledger, self.leases = state.l1, state.table, state.ledger, state.leases
        self.groups, self.counters, self.hooks = state.groups, state.counters, state.hooks
        self.reservations, self.admission = state.reservations, state.admission
        self.keys = keys
        self.reservations.abort_stores = self._abort_stores  # a rollback aborts the producer's open stores

    def store(self, f: Store, who: Identity = ADMIN) -> StoreReply:
        ks, salt, rank = f.keyspace.key(), who.salt(f.salt), f.rank
        t = self.ledger.counters(who)
        if rank >= ks[1]:
            raise OutOfRange("rank must be < world_size")
        sizes = self.admission.sizes(ks)
        hashes = self.keys.hashes(f, len(ks[2]), who)
        self.admission.open(who)
        start = f.start_chunk
        if start > len(hashes):
            raise OutOfRange("start_chunk beyond the last full chunk")
        tail_chunk, mark = -1, None
        if f.tail and self.keys.store_tail(f, ks, salt, hashes, rank, start):  # the partial last chunk: one more
            self.counters.stored_tails += 1
            tail_chunk, mark = len(hashes) - 1, TailMark(len(f.tokens) // 4 % self.keys.chunk_size, ks[2])
        book, res = self.reservations, None
        if f.reservation is not None:
            res = book.for_store(
                who.scope(f.reservation),
                who.tenant,
                f.total_chunks,
                sizes,
                ks,
                salt,
                rank,
                hashes,
                start,
                self.ledger.limits(who.tenant)[0],
            )
        admit = self.admission.objects(who, booked=res is not None)  # plain stores leave bookings alone
        txn = StoreTxn(
            new_store_id(),
            f.mode,
            None if f.session is None else who.scope(f.session),
            [],
            self.table.deadline(),
            keyspace=ks,
            salt=salt,
            tokens=f.tokens,
            hashes=hashes,
            owner=who.tenant,
            reservation=None if res is None else res.id,
        )
        reply_slots: list[StoreSlot] = []
        for chunk, group, key in self.groups.store_objects(ks, salt, rank, hashes, start):
            got = admit.take(key, sizes[group], hashes[chunk - 1] if chunk else None)
            if isinstance(got, str):
                if got == "no_space":
                    self.counters.no_space += 1
                else:
                    self.counters.deduplicated_objects += 1
                    if res is not None:
                        book.draw(res, sizes[group], key, False, (ks[0], ks[1], salt, hashes[chunk]))
                reply_slots.append(StoreSlot(chunk, group, got))
                continue
            if chunk == tail_chunk:
                got.tail = mark  # journaled with it: a restarted server finds the tail again
            txn.slots.append(Slot(key, chunk, group, got))
            if res is not None:
                book.draw(res, sizes[group], key, True, (ks[0], ks[1], salt, hashes[chunk]))
            reply_slots.append(StoreSlot(chunk, group, "reserved", got.size, got.offset if txn.mode == "shm" else None))
        if txn.slots:
            self.table.stores[txn.id] = txn
        if res is not None:
            book.cover(res, rank, start, len(hashes))
            if txn.slots:
                res.stores.add(txn.id)
            book.advance(res, (ks[0], ks[1], salt, hashes[-1]) if hashes else None)
            book.settle(res, None)
        self.counters.stores += 1
        t.stores += 1
        return StoreReply(txn.id if txn.slots else None, reply_slots)

    def _own_store(self, store_id: str, who: Identity) -> StoreTxn:
        """The caller's store transaction; another tenant's is as unknown as one that never existed."""
        txn = self.table.stores.get(store_id)
        if txn is None or txn.owner != who.tenant:
            self.counters.late_write_dropped += self.leases.late.arrived(store_id, who.tenant)
            raise UnknownStore(f"unknown or expired store {store_id}")
        return txn

    def commit(
        self, store_id: str, frames: list[memoryview], checksums: list[int], who: Identity = ADMIN
    ) -> CommitReply:
        txn = self._own_store(store_id, who)
        if txn.expires <= time.monotonic():  # expired, the sweep just has not run yet: same answer
            del self.table.stores[store_id]
            self.leases.end_write(txn)
            self.leases.late.arrived(store_id, who.tenant)  # its slots are quarantined: nothing reused yet
            self.counters.late_commits += 1
            self.counters.expired_stores += 1
            raise UnknownStore(f"unknown or expired store {store_id}")
        if len(checksums) != len(txn.slots):
            raise BadField(f"expected {len(txn.slots)} checksums, got {len(checksums)}")
        if txn.mode == "tcp":
            if len(frames) != len(txn.slots):
                raise BadField(f"expected {len(txn.slots)} data frames, got {len(frames)}")
            for slot, frame in zip(txn.slots, frames, strict=True):
                if len(frame) != slot.entry.size:
                    raise BadField(f"frame for chunk {slot.chunk} has {len(frame)} bytes, expected {slot.entry.size}")
            for slot, frame in zip(txn.slots, frames, strict=True):
                self.l1.arena.write(slot.entry.offset, frame)
        elif frames:
            raise BadField("shm-mode commit takes no data frames")
        elif not who.shm:  # shm taken away since the store began: its slots hold no bytes of this tenant's
            raise Forbidden(
                f"tenant {who.tenant!r} may no longer commit an shm-mode store; abort it and store over tcp"
            )
        del self.table.stores[store_id]
        for slot, checksum in zip(txn.slots, checksums, strict=True):
            slot.entry.checksum = checksum  # never verified here: the server does not read the bytes
        for slot in reversed(txn.slots):  # the tail enters the policy first, the head last (see lookup)
            self.l1.finish_write(slot.key)
            if txn.kind == "prefix":  # blend stores count in their own counters (blend_index.py)
                self.counters.stored_bytes += slot.entry.size
        if txn.kind == "prefix":
            self.counters.stored_objects += len(txn.slots)
        t = self.ledger.counters(who)
        t.stored_objects += len(txn.slots)
        t.stored_bytes += sum(s.entry.size for s in txn.slots)
        res = None if txn.reservation is None else self.reservations.live.get(txn.reservation)
        if res is not None:  # held until the whole request is in, then released at once
            self.reservations.hold(res, [s.key for s in txn.slots])
            self.reservations.settle(res, store_id)
        keys = [s.key for s in txn.slots]
        for hook in self.hooks.commit:
            hook(keys)
        for txn_hook in self.hooks.commit_txn:
            txn_hook(txn)
        return CommitReply(len(txn.slots))

    def abort(self, store_id: str, who: Identity = ADMIN) -> AbortReply:
        txn = self._own_store(store_id, who)
        del self.table.stores[store_id]
        self._abort_txn(txn)
        return AbortReply(len(txn.slots))

    def abort_session(self, session_id: str) -> int:
        """Abort every open store of a session (end_session); how many there were."""
        aborted = 0
        for txn in [t for t in self.table.stores.values() if t.session == session_id]:
            del self.table.stores[txn.id]
            self._abort_txn(txn)
            aborted += 1
        return aborted

    def _abort_txn(self, txn: StoreTxn) -> None:
        self.leases.end_write(txn)
        res = None if txn.reservation is None else self.reservations.live.get(txn.reservation)
        if res is not None:  # a producer that gives up a part gives up the whole request
            res.stores.discard(txn.id)
            self.reservations.rollback(res)

    def _abort_stores(self, store_ids: Iterable[str]) -> None:
        """End a rolled-back reservation's open stores (their slots quarantined like any abort's)."""
        for sid in list(store_ids):
            txn = self.table.stores.pop(sid, None)
            if txn is not None:
                self.leases.end_write(txn)


__all__ = ["WriteOps"]
