"""The cache service: lookup, store, commit, retrieve and friends over L1 and the session table.

Handlers receive typed requests (kvprotocol._requests Structs, already checked) and return results.
Everything runs on the server's single event-loop thread, so no locks are needed and no operation
ever waits on another.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from kvprotocol import MAX_KEYS, ErrorCode, ValidationError, chunk_hashes
from kvprotocol._requests import KeysRequest, Lookup, Query, RegisterEngine, Release, Retrieve, Store

from .engines import Engine, EngineTable
from .groups import GroupBook
from .l1 import IKey, L1Cache, State
from .l2.background import BackgroundPrefetches
from .leases import Leases
from .sessions import KeySpaceT, SessionTable, Slot, StoreTxn, new_store_id
from .ledger import Counters, TenantLedger
from .reservations import ReservationBook
from .tenants import ADMIN, Identity, TenantBook

if TYPE_CHECKING:
    from .l2 import TierManager


log = logging.getLogger("kvserver")


MAX_SESSIONS = 4096  # live read sessions per server, all tenants together (each tenant has its own cap too)
MAX_SESSION_OBJECTS = 1 << 22  # chunk hashes + leased keys all live sessions keep, in total
MAX_STORES = 4096  # store transactions in flight per server


def _fail(code: ErrorCode, message: str) -> ValidationError:
    return ValidationError(code, message)


class CacheService:
    def __init__(self, l1: L1Cache, chunk_size: int, lease_ttl: float, tenants: TenantBook | None = None) -> None:
        self.l1 = l1
        self.chunk_size = chunk_size
        self.table = SessionTable(lease_ttl)
        self.ledger = TenantLedger(l1, self.table, tenants, (MAX_SESSIONS, MAX_STORES))
        self.leases = Leases(l1, self.table)
        self.engine_table = EngineTable()
        self.groups = GroupBook(chunk_size)  # per-group geometry (sliding, state, shared, chunk sizes)
        self.object_sizes: dict[str, int] = {}  # layout fingerprint -> object bytes
        self.counters = Counters()
        self.on_commit: list[Callable[[list[IKey]], None]] = []  # e.g. L2 write-behind
        self.on_hit: list[Callable[[list[IKey]], None]] = []  # objects a lookup hit (L2 admission)
        self.on_commit_txn: list[Callable[[StoreTxn], None]] = []  # e.g. KV events (need tokens, keyspace)
        # after an L2 prefetch: (keyspace, salt, tokens, chunk hashes, first chunk that missed before)
        self.on_prefetched: list[Callable[[KeySpaceT, str, bytes, list[bytes], int], None]] = []
        self.l2: TierManager | None = None  # L2 prefetch on lookup misses (set by the server)
        self.background = BackgroundPrefetches()  # prefetches of lookups that did not wait
        self.reservations = ReservationBook(l1, lease_ttl)  # whole-request admission (kv_producer stores)
        self.reservations.abort_stores = self._abort_stores

    @property
    def engines(self) -> dict[str, Engine]:
        """Registered engine ranks by id (describe, the fleet agent)."""
        return self.engine_table.engines

    # -- helpers -------------------------------------------------------------------------------
    @staticmethod
    def _ks(keyspace: dict[str, Any]) -> KeySpaceT:
        """A keyspace map (field-map handlers, e.g. blend_index.py) as the server's key tuple."""
        return (keyspace["model"], keyspace["world_size"], tuple(keyspace["groups"]))

    def _chunk_keys(self, ks: KeySpaceT, salt: str, chunk_hash: bytes, c: int = -1) -> list[IKey]:
        """Every (rank, group) object of one chunk (with a geometry: every object ending at unit c)."""
        plan = self.groups.plan(ks)
        if plan is not None:
            return plan.ending_at(salt, chunk_hash, c)
        model, world, groups = ks
        return [(model, fp, world, rank, g, salt, chunk_hash) for rank in range(world) for g, fp in enumerate(groups)]

    def _prefix_hits(self, ks: KeySpaceT, salt: str, hashes: list[bytes]) -> int:
        """Largest k such that every (group, rank) object of chunks 0..k-1 is ready in L1."""
        ready = self.l1.ready  # the hot path of every lookup: plain loops, no generators
        plan = self.groups.plan(ks)
        if plan is not None:
            return plan.hit(salt, hashes, ready)
        for i, h in enumerate(hashes):
            for key in self._chunk_keys(ks, salt, h):
                if ready(key) is None:
                    return i
        return len(hashes)

    def _hashes(self, f: KeysRequest, per_chunk: int) -> list[bytes]:
        """The request's chunk hashes, its per-chunk extra keys folded in (kvprotocol's one definition).

        Runs before a handler changes anything: a request naming more than MAX_KEYS objects is
        TOO_LARGE before any hashing, and an extra key beyond the last full chunk is OUT_OF_RANGE.
        """
        chunks = len(f.tokens) // 4 // self.chunk_size
        if chunks * per_chunk > MAX_KEYS:
            raise _fail(ErrorCode.TOO_LARGE, f"{chunks} chunks x {per_chunk} objects each is over "
                                             f"{MAX_KEYS} objects per request")
        try:
            return chunk_hashes(f.tokens, self.chunk_size, f.extra or ())
        except IndexError as exc:
            raise _fail(ErrorCode.OUT_OF_RANGE, str(exc)) from None

    @staticmethod
    def _per_chunk(f: KeysRequest) -> int:
        return f.keyspace.per_chunk

    def _admit_session(self, session_id: str, objects: int, who: Identity = ADMIN) -> None:
        """Refuse a new session past the per-server and per-tenant caps (after sweeping expired ones)."""
        if session_id in self.table.sessions:
            return
        self.ledger.admit_session(who, self.expire)
        if len(self.table.sessions) >= MAX_SESSIONS or self.leases.objects + objects > MAX_SESSION_OBJECTS:
            self.expire()
        if len(self.table.sessions) >= MAX_SESSIONS:
            raise _fail(ErrorCode.TOO_MANY, f"{MAX_SESSIONS} sessions are live; end some first")
        if self.leases.objects + objects > MAX_SESSION_OBJECTS:
            raise _fail(ErrorCode.TOO_MANY, "live sessions hold too many objects; end some first")

    # -- engines -------------------------------------------------------------------------------
    def register_engine(self, f: RegisterEngine, engine_id: str) -> dict[str, Any]:
        layouts = f.layouts()
        for layout in layouts:
            if layout.chunk_size % self.chunk_size:
                raise _fail(ErrorCode.LAYOUT_MISMATCH, f"layout chunk_size {layout.chunk_size} is not a "
                                                       f"multiple of the server chunk_size {self.chunk_size}")
            if layout.object_bytes > self.l1.alloc.capacity:
                raise _fail(ErrorCode.NO_SPACE, "one object is larger than the whole L1 arena")
        if f.rank >= f.world_size:
            raise _fail(ErrorCode.OUT_OF_RANGE, "rank must be < world_size")
        for layout in layouts:
            self.object_sizes[layout.fingerprint] = layout.object_bytes
            self.groups.add(layout)
        engine_id = self.engine_table.add(Engine(engine_id, f.model, f.world_size, f.rank,
                                                 [g.to_wire() for g in layouts], f.host or "", f.pid or 0),
                                          [g.fingerprint for g in layouts])
        return {
            "engine_id": engine_id,
            "arena": {"name": self.l1.arena.name, "size": self.l1.arena.size, "nonce": self.l1.arena.nonce},
            "chunk_size": self.chunk_size,
            "groups": [g.fingerprint for g in layouts],
        }

    # -- lookup / query --------------------------------------------------------------------------
    def lookup(self, f: Lookup, who: Identity = ADMIN, hashes: list[bytes] | None = None) -> dict[str, Any]:
        ks, salt = f.keyspace.key(), who.salt(f.salt)
        hashes = self._hashes(f, self._per_chunk(f)) if hashes is None else hashes
        session = None if f.session is None else who.scope(f.session)
        if session is not None:
            self._admit_session(session, len(hashes) * (1 + self._per_chunk(f)), who)
        hit = self._prefix_hits(ks, salt, hashes)
        c = self.counters
        c.lookups += 1
        c.lookup_tokens += len(f.tokens) // 4
        c.lookup_hit_tokens += hit * self.chunk_size
        t = self.ledger.counters(who)
        t.lookups += 1
        t.lookup_tokens += len(f.tokens) // 4
        t.lookup_hit_tokens += hit * self.chunk_size
        rank = f.rank
        if rank is not None and rank >= ks[1]:
            raise _fail(ErrorCode.OUT_OF_RANGE, "rank must be < world_size")
        out = {"hit_tokens": hit * self.chunk_size, "hit_chunks": hit, "num_chunks": len(hashes),
               "chunk_size": self.chunk_size}
        plan, keys_of = self.groups.plan(ks), None
        if plan is not None:  # per-group geometry: the objects this hit needs (groups.py)
            keys_of = plan.touch_hit(salt, hashes, hit, self.l1.touch, self.on_hit)
        else:
            touch = self.l1.touch
            for h in reversed(hashes[:hit]):  # tail first: a prefix's head ends up the most recently used
                for key in self._chunk_keys(ks, salt, h):
                    touch(key)
            if self.on_hit and hit:
                hit_keys = [k for h in hashes[:hit] for k in self._chunk_keys(ks, salt, h)]
                for hook in self.on_hit:
                    hook(hit_keys)
        if self.reservations.live and hit < len(hashes):
            refs = [(ks[0], ks[1], salt, h) for h in hashes[: hit + 1]]
            if self.reservations.inflight(refs, hit):  # "ask again later": nothing is leased for it
                out["inflight"] = True
                return out
        if session is not None:  # a repeated lookup replaces the earlier leases (of that rank only, with rank)
            self.leases.take(session, ks, salt, hashes, hit, rank, keys_of)
        return out

    async def lookup_l2(self, f: Lookup, who: Identity = ADMIN) -> dict[str, Any]:
        """lookup, after loading what L2 holds of the missing prefix into L1 (a bounded wait).

        The answer counts only what is in L1 when the wait ends; see l2/prefetch.py.
        """
        ks, salt = f.keyspace.key(), who.salt(f.salt)
        hashes = self._hashes(f, self._per_chunk(f))
        if f.session is not None:
            self._admit_session(who.scope(f.session), len(hashes) * (1 + self._per_chunk(f)), who)
        hit = self._prefix_hits(ks, salt, hashes)
        pending = False
        if self.l2 is not None and hit < len(hashes):
            plan = self.groups.plan(ks)  # with a geometry, snapshots and states are useful without a leading run
            sets = [self._chunk_keys(ks, salt, h) for h in hashes] if plan is None else plan.prefetch_sets(salt, hashes)
            tokens = f.tokens

            async def prefetch() -> None:
                assert self.l2 is not None
                await self.l2.prefetch(sets, hit if plan is None else 0, lambda key: self.object_sizes.get(key[1]),
                                       leading=plan is None)
                self.l1.link_chain(ks[0], ks[1], salt, hashes)
                for hook in self.on_prefetched:
                    hook(ks, salt, tokens, hashes, hit)

            if f.wait:
                await prefetch()
            else:  # answer now; the engine asks again (see l2/background.py)
                pending = self.background.poll((ks, salt, hashes[hit], hashes[-1]), prefetch)
        out = self.lookup(f, who, hashes)  # no await since the wait: the prefix is recomputed and leased at once
        if not f.wait:
            out["pending"] = pending
        return out

    def _query_keys(self, f: KeysRequest, who: Identity) -> tuple[list[bytes], list[list[IKey]]]:
        ks, salt = f.keyspace.key(), who.salt(f.salt)
        hashes = self._hashes(f, self._per_chunk(f))
        return hashes, [self._chunk_keys(ks, salt, h, c) for c, h in enumerate(hashes)]

    def query(self, f: Query, who: Identity = ADMIN) -> dict[str, Any]:
        """Per-chunk presence in L1 (objects ready of objects needed) and the reusable prefix."""
        return self._query(f, who)[0]

    def _query(self, f: Query, who: Identity) -> tuple[dict[str, Any], list[list[IKey]]]:
        hashes, per_chunk = self._query_keys(f, who)
        ready = self.l1.ready
        present = [sum(1 for k in keys if ready(k) is not None) for keys in per_chunk]
        chunks = [{"hash": h.hex(), "l1": n, "objects": len(keys)} for h, n, keys in zip(hashes, present, per_chunk)]
        hit = next((i for i, (n, keys) in enumerate(zip(present, per_chunk)) if n < len(keys)), len(chunks))
        if self.groups.plan(f.keyspace.key()) is not None:  # not a plain prefix rule: the fold decides
            hit = self._prefix_hits(f.keyspace.key(), who.salt(f.salt), hashes)
        result = {"chunks": chunks, "prefix_tokens": hit * self.chunk_size, "chunk_size": self.chunk_size}
        return result, per_chunk

    async def query_l2(self, f: Query, who: Identity = ADMIN) -> dict[str, Any]:
        """query, plus presence per L2 tier: `l2` when one tier is configured, `l2.<i>` for each of several.

        A tier that is down or slower than the prefetch timeout reports nothing for that query.
        """
        result, per_chunk = self._query(f, who)
        if self.l2 is None:
            return result
        flat = [k for keys in per_chunk for k in keys]
        per_tier = await self.l2.presence(flat)
        names = ["l2"] if len(per_tier) == 1 else [f"l2.{i}" for i in range(len(per_tier))]
        for name, present in zip(names, per_tier):
            if present is None:
                continue
            pos = 0
            for chunk, keys in zip(result["chunks"], per_chunk):
                chunk[name] = sum(present[pos : pos + len(keys)])
                pos += len(keys)
        return result

    def set_pinned(self, f: KeysRequest, pinned: bool, who: Identity = ADMIN) -> dict[str, Any]:
        ks, salt = f.keyspace.key(), who.salt(f.salt)
        changed = 0
        for c, h in enumerate(self._hashes(f, self._per_chunk(f))):
            for key in self._chunk_keys(ks, salt, h, c):
                changed += self.l1.set_pinned(key, pinned)
        return {"objects": changed}

    # -- store ---------------------------------------------------------------------------------
    def store(self, f: Store, who: Identity = ADMIN) -> dict[str, Any]:
        ks, salt, rank = f.keyspace.key(), who.salt(f.salt), f.rank
        t = self.ledger.counters(who)
        if rank >= ks[1]:
            raise _fail(ErrorCode.OUT_OF_RANGE, "rank must be < world_size")
        sizes = []
        for fp in ks[2]:
            if fp not in self.object_sizes:
                raise _fail(ErrorCode.LAYOUT_MISMATCH, f"layout {fp} is not registered by any engine")
            sizes.append(self.object_sizes[fp])
        hashes = self._hashes(f, len(ks[2]))
        if len(self.table.stores) >= MAX_STORES:
            self.expire()
        if len(self.table.stores) >= MAX_STORES:
            raise _fail(ErrorCode.TOO_MANY, f"{MAX_STORES} stores are in flight; commit or abort some first")
        self.ledger.admit_store(who)
        start = f.start_chunk
        if start > len(hashes):
            raise _fail(ErrorCode.OUT_OF_RANGE, "start_chunk beyond the last full chunk")
        book, res = self.reservations, None
        if f.reservation is not None:
            res = book.for_store(who.scope(f.reservation), who.tenant, f.total_chunks, sizes, ks, salt, rank, hashes,
                                 start, self.ledger.limits(who.tenant)[0])
        budget = book.headroom() if res is None and book.live else None  # plain stores leave bookings alone
        txn = StoreTxn(new_store_id(), f.mode, None if f.session is None else who.scope(f.session), [],
                       self.table.deadline(), keyspace=ks, salt=salt, tokens=f.tokens, hashes=hashes,
                       owner=who.tenant, reservation=None if res is None else res.id)
        reply_slots = []
        for chunk, group, key in self.groups.store_objects(ks, salt, rank, hashes, start):
            existing = self.l1.entries.get(key)
            if existing is not None:
                status = "present" if existing.state is State.READY else "writing"
                self.counters.deduplicated_objects += 1
                reply_slots.append({"chunk": chunk, "group": group, "status": status})
                if res is not None:
                    book.draw(res, sizes[group], key, False, (ks[0], ks[1], salt, hashes[chunk]))
                continue
            if budget is not None:
                budget -= self.l1.alloc.slot_size(sizes[group])
            if (budget is not None and budget < 0) or not self.ledger.make_room(who, sizes[group]):
                self.counters.no_space += 1
                reply_slots.append({"chunk": chunk, "group": group, "status": "no_space"})
                continue
            entry = self.l1.reserve(key, sizes[group], hashes[chunk - 1] if chunk else None)
            if entry is None:
                self.counters.no_space += 1
                reply_slots.append({"chunk": chunk, "group": group, "status": "no_space"})
                continue
            txn.slots.append(Slot(key, chunk, group, entry))
            if res is not None:
                book.draw(res, sizes[group], key, True, (ks[0], ks[1], salt, hashes[chunk]))
            slot = {"chunk": chunk, "group": group, "status": "reserved", "size": entry.size}
            if txn.mode == "shm":
                slot["offset"] = entry.offset
            reply_slots.append(slot)
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
        return {"store_id": txn.id if txn.slots else None, "slots": reply_slots}

    def _own_store(self, store_id: str, who: Identity) -> StoreTxn:
        """The caller's store transaction; another tenant's is as unknown as one that never existed."""
        txn = self.table.stores.get(store_id)
        if txn is None or txn.owner != who.tenant:
            raise _fail(ErrorCode.UNKNOWN_STORE, f"unknown or expired store {store_id}")
        return txn

    def commit(self, store_id: str, frames: list[memoryview], checksums: list[int],
               who: Identity = ADMIN) -> dict[str, Any]:
        txn = self._own_store(store_id, who)
        if txn.expires <= time.monotonic():  # expired, the sweep just has not run yet: same answer
            del self.table.stores[store_id]
            self.leases.end_write(txn)
            self.counters.late_commits += 1
            self.counters.expired_stores += 1
            raise _fail(ErrorCode.UNKNOWN_STORE, f"unknown or expired store {store_id}")
        if len(checksums) != len(txn.slots):
            raise _fail(ErrorCode.BAD_FIELD, f"expected {len(txn.slots)} checksums, got {len(checksums)}")
        if txn.mode == "tcp":
            if len(frames) != len(txn.slots):
                raise _fail(ErrorCode.BAD_FIELD, f"expected {len(txn.slots)} data frames, got {len(frames)}")
            for slot, frame in zip(txn.slots, frames, strict=True):
                if len(frame) != slot.entry.size:
                    raise _fail(ErrorCode.BAD_FIELD, f"frame for chunk {slot.chunk} has {len(frame)} bytes, "
                                                     f"expected {slot.entry.size}")
            for slot, frame in zip(txn.slots, frames, strict=True):
                self.l1.arena.write(slot.entry.offset, frame)
        elif frames:
            raise _fail(ErrorCode.BAD_FIELD, "shm-mode commit takes no data frames")
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
        for hook in self.on_commit:
            hook(keys)
        for txn_hook in self.on_commit_txn:
            txn_hook(txn)
        return {"committed": len(txn.slots)}

    def abort(self, store_id: str, who: Identity = ADMIN) -> dict[str, Any]:
        txn = self._own_store(store_id, who)
        del self.table.stores[store_id]
        self._abort_txn(txn)
        return {"aborted": len(txn.slots)}

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

    # -- retrieve ------------------------------------------------------------------------------
    def retrieve(self, f: Retrieve, who: Identity = ADMIN) -> tuple[dict[str, Any], list[bytes]]:
        """Offsets (shm) or copies (tcp) of one rank's leased objects, and the reader's lease number.

        tcp frames are copies, never views of the arena: a frame may wait in ZMQ's queue after the
        lease ends, and a view would then send whatever object reuses the slot.
        """
        start, end, rank = f.start_chunk, f.end_chunk, f.rank
        reader = self.leases.reader(who.scope(f.session), rank)
        if not start <= end <= reader.hit_chunks:
            raise _fail(ErrorCode.NOT_LEASED, f"chunks [{start}, {end}) not within the leased prefix "
                                              f"of {reader.hit_chunks} chunks")
        mode = f.mode
        objects, frames = [], []
        for chunk, group, key in self.groups.retrieve_objects(reader.keyspace, reader.salt, reader.hashes,
                                                              reader.hit_chunks, rank, start, end):
            entry = self.l1.entries[key]  # leased, so present and ready
            obj = {"chunk": chunk, "group": group, "size": entry.size, "checksum": entry.checksum}
            if mode == "shm":
                obj["offset"] = entry.offset
            else:
                frames.append(bytes(self.l1.arena.read(entry.offset, entry.size)))
            objects.append(obj)
            self.counters.retrieved_bytes += entry.size
        self.counters.retrieves += 1
        t = self.ledger.counters(who)
        t.retrieves += 1
        t.retrieved_bytes += sum(o["size"] for o in objects)
        return {"objects": objects, "lease": reader.lease}, frames

    # -- sessions ------------------------------------------------------------------------------
    def release(self, f: Release, who: Identity = ADMIN) -> dict[str, Any]:
        """`{released, intact}`: see leases.Leases.release."""
        result = self.leases.release(who.scope(f.session), f.rank, f.lease)
        if f.lease is not None and not result["intact"]:
            self.counters.broken_reads += 1
        return result

    def end_session(self, session: str, who: Identity = ADMIN) -> dict[str, Any]:
        session_id = who.scope(session)
        released = self.leases.drop(session_id)
        aborted = 0
        for txn in [t for t in self.table.stores.values() if t.session == session_id]:
            del self.table.stores[txn.id]
            self._abort_txn(txn)
            aborted += 1
        return {"released": released, "aborted_stores": aborted}

    def expire(self, now: float | None = None) -> None:
        for res in self.reservations.expired(time.monotonic() if now is None else now):
            self.reservations.rollback(res)  # its producer went quiet: died or gave up
        sessions, stores = self.leases.expire(now)
        self.counters.expired_sessions += sessions
        self.counters.expired_stores += stores

    def clear(self) -> dict[str, Any]:
        return {"removed": self.l1.clear()}
