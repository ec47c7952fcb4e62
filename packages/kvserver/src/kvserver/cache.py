"""The cache service: lookup, store, commit, retrieve and friends over L1 and the session table.

Handlers receive fields already validated by kvprotocol's schema and return (result, frames).
Everything runs on the server's single event-loop thread, so no locks are needed and no operation
ever waits on another.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvprotocol import MAX_KEYS, ErrorCode, ValidationError, chunk_hashes

from .l1 import IKey, L1Cache, State
from .l2.background import BackgroundPrefetches
from .leases import Leases, rank_keys
from .sessions import KeySpaceT, SessionTable, Slot, StoreTxn, new_store_id

if TYPE_CHECKING:
    from .l2 import TierManager


@dataclass
class Engine:
    id: str
    model: str
    world_size: int
    rank: int
    groups: list[dict[str, Any]]
    host: str
    pid: int
    registered_at: float = field(default_factory=time.time)


@dataclass
class Counters:
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


log = logging.getLogger("kvserver")
MAX_ENGINES = 256  # registrations kept for describe; the oldest go first
MAX_SESSIONS = 4096  # live read sessions per server (an identity is the one server credential for now)
MAX_SESSION_OBJECTS = 1 << 22  # chunk hashes + leased keys all live sessions keep, in total
MAX_STORES = 4096  # store transactions in flight per server


def _fail(code: ErrorCode, message: str) -> ValidationError:
    return ValidationError(code, message)


class CacheService:
    def __init__(self, l1: L1Cache, chunk_size: int, lease_ttl: float) -> None:
        self.l1 = l1
        self.chunk_size = chunk_size
        self.table = SessionTable(lease_ttl)
        self.leases = Leases(l1, self.table)
        self.engines: dict[str, Engine] = {}
        self.object_sizes: dict[str, int] = {}  # layout fingerprint -> object bytes
        self.counters = Counters()
        self.on_commit: list[Callable[[list[IKey]], None]] = []  # e.g. L2 write-behind
        self.on_commit_txn: list[Callable[[StoreTxn], None]] = []  # e.g. KV events (need tokens, keyspace)
        # after an L2 prefetch: (keyspace, salt, tokens, chunk hashes, first chunk that missed before)
        self.on_prefetched: list[Callable[[KeySpaceT, str, bytes, list[bytes], int], None]] = []
        self.l2: TierManager | None = None  # L2 prefetch on lookup misses (set by the server)
        self.background = BackgroundPrefetches()  # prefetches of lookups that did not wait

    # -- helpers -------------------------------------------------------------------------------
    @staticmethod
    def _ks(keyspace: dict[str, Any]) -> KeySpaceT:
        return (keyspace["model"], keyspace["world_size"], tuple(keyspace["groups"]))

    def _keys(self, ks: KeySpaceT, salt: str, rank: int, chunk_hash: bytes) -> list[IKey]:
        return rank_keys(ks, salt, rank, [chunk_hash])

    def _chunk_keys(self, ks: KeySpaceT, salt: str, chunk_hash: bytes) -> list[IKey]:
        """Every (rank, group) object of one chunk: all of them must be present for a hit."""
        model, world, groups = ks
        return [(model, fp, world, rank, g, salt, chunk_hash) for rank in range(world) for g, fp in enumerate(groups)]

    def _prefix_hits(self, ks: KeySpaceT, salt: str, hashes: list[bytes]) -> int:
        """Largest k such that every (group, rank) object of chunks 0..k-1 is ready in L1."""
        ready = self.l1.ready  # the hot path of every lookup: plain loops, no generators
        for i, h in enumerate(hashes):
            for key in self._chunk_keys(ks, salt, h):
                if ready(key) is None:
                    return i
        return len(hashes)

    def _hashes(self, f: dict[str, Any], per_chunk: int) -> list[bytes]:
        """The request's chunk hashes, its per-chunk extra keys folded in (kvprotocol's one definition).

        Runs before a handler changes anything: a request naming more than MAX_KEYS objects is
        TOO_LARGE before any hashing, and an extra key beyond the last full chunk is OUT_OF_RANGE.
        """
        chunks = len(f["tokens"]) // 4 // self.chunk_size
        if chunks * per_chunk > MAX_KEYS:
            raise _fail(ErrorCode.TOO_LARGE, f"{chunks} chunks x {per_chunk} objects each is over "
                                             f"{MAX_KEYS} objects per request")
        try:
            return chunk_hashes(f["tokens"], self.chunk_size, f.get("extra", ()))
        except IndexError as exc:
            raise _fail(ErrorCode.OUT_OF_RANGE, str(exc)) from None

    @staticmethod
    def _per_chunk(f: dict[str, Any]) -> int:
        return int(f["keyspace"]["world_size"]) * len(f["keyspace"]["groups"])

    def _admit_session(self, session_id: str, objects: int) -> None:
        """Refuse a new session past the per-server caps (after sweeping expired ones)."""
        if session_id in self.table.sessions:
            return
        if len(self.table.sessions) >= MAX_SESSIONS or self.leases.objects + objects > MAX_SESSION_OBJECTS:
            self.expire()
        if len(self.table.sessions) >= MAX_SESSIONS:
            raise _fail(ErrorCode.TOO_MANY, f"{MAX_SESSIONS} sessions are live; end some first")
        if self.leases.objects + objects > MAX_SESSION_OBJECTS:
            raise _fail(ErrorCode.TOO_MANY, "live sessions hold too many objects; end some first")

    # -- engines -------------------------------------------------------------------------------
    def register_engine(self, f: dict[str, Any], engine_id: str) -> dict[str, Any]:
        for layout in f["groups"]:
            if layout.chunk_size != self.chunk_size:
                raise _fail(ErrorCode.LAYOUT_MISMATCH,
                            f"layout chunk_size {layout.chunk_size} != server chunk_size {self.chunk_size}")
            if layout.object_bytes > self.l1.alloc.capacity:
                raise _fail(ErrorCode.NO_SPACE, "one object is larger than the whole L1 arena")
        if f["rank"] >= f["world_size"]:
            raise _fail(ErrorCode.OUT_OF_RANGE, "rank must be < world_size")
        for layout in f["groups"]:
            self.object_sizes[layout.fingerprint] = layout.object_bytes
        engine = Engine(engine_id, f["model"], f["world_size"], f["rank"], [g.to_wire() for g in f["groups"]],
                        f.get("host", ""), f.get("pid", 0))
        # The same process registering again (a reconnect) keeps its id; the table stays bounded.
        again = False
        for old in list(self.engines.values()):
            if (old.model, old.world_size, old.rank, old.groups, old.host, old.pid) == (
                    engine.model, engine.world_size, engine.rank, engine.groups, engine.host, engine.pid) and engine.pid:
                del self.engines[old.id]
                engine.id = engine_id = old.id
                again = True
        self.engines[engine_id] = engine
        log.info("engine %s %s: model=%s rank=%d/%d host=%s pid=%d layouts=%s", engine_id,
                 "registered again" if again else "registered", engine.model, engine.rank, engine.world_size,
                 engine.host or "-", engine.pid, ",".join(g.fingerprint for g in f["groups"]))
        while len(self.engines) > MAX_ENGINES:
            del self.engines[next(iter(self.engines))]
        return {
            "engine_id": engine_id,
            "arena": {"name": self.l1.arena.name, "size": self.l1.arena.size, "nonce": self.l1.arena.nonce},
            "chunk_size": self.chunk_size,
            "groups": [g.fingerprint for g in f["groups"]],
        }

    # -- lookup / query --------------------------------------------------------------------------
    def lookup(self, f: dict[str, Any], hashes: list[bytes] | None = None) -> dict[str, Any]:
        ks, salt = self._ks(f["keyspace"]), f.get("salt", "")
        hashes = self._hashes(f, self._per_chunk(f)) if hashes is None else hashes
        if "session" in f:
            self._admit_session(f["session"], len(hashes) * (1 + self._per_chunk(f)))
        hit = self._prefix_hits(ks, salt, hashes)
        c = self.counters
        c.lookups += 1
        c.lookup_tokens += len(f["tokens"]) // 4
        c.lookup_hit_tokens += hit * self.chunk_size
        rank = f.get("rank")
        if rank is not None and rank >= ks[1]:
            raise _fail(ErrorCode.OUT_OF_RANGE, "rank must be < world_size")
        touch = self.l1.touch
        for h in hashes[:hit]:
            for key in self._chunk_keys(ks, salt, h):
                touch(key)
        if "session" in f:  # a repeated lookup replaces the earlier leases (of that rank only, with rank)
            self.leases.take(f["session"], ks, salt, hashes, hit, rank)
        return {"hit_tokens": hit * self.chunk_size, "hit_chunks": hit, "num_chunks": len(hashes),
                "chunk_size": self.chunk_size}

    async def lookup_l2(self, f: dict[str, Any]) -> dict[str, Any]:
        """lookup, after loading what L2 holds of the missing prefix into L1 (a bounded wait).

        The answer counts only what is in L1 when the wait ends; see l2/prefetch.py.
        """
        ks, salt = self._ks(f["keyspace"]), f.get("salt", "")
        hashes = self._hashes(f, self._per_chunk(f))
        if "session" in f:
            self._admit_session(f["session"], len(hashes) * (1 + self._per_chunk(f)))
        hit = self._prefix_hits(ks, salt, hashes)
        wait = f.get("wait", True)
        pending = False
        if self.l2 is not None and hit < len(hashes):
            chunks = [self._chunk_keys(ks, salt, h) for h in hashes]
            tokens = f["tokens"]

            async def prefetch() -> None:
                assert self.l2 is not None
                await self.l2.prefetch(chunks, hit, lambda key: self.object_sizes.get(key[1]))
                for hook in self.on_prefetched:
                    hook(ks, salt, tokens, hashes, hit)

            if wait:
                await prefetch()
            else:  # answer now; the engine asks again (see l2/background.py)
                pending = self.background.poll((ks, salt, hashes[hit], hashes[-1]), prefetch)
        out = self.lookup(f, hashes)  # no await since the wait: the prefix is recomputed and leased at once
        if not wait:
            out["pending"] = pending
        return out

    def _query_keys(self, f: dict[str, Any]) -> tuple[list[bytes], list[list[IKey]]]:
        ks, salt = self._ks(f["keyspace"]), f.get("salt", "")
        hashes = self._hashes(f, self._per_chunk(f))
        return hashes, [self._chunk_keys(ks, salt, h) for h in hashes]

    def query(self, f: dict[str, Any]) -> dict[str, Any]:
        """Per-chunk presence in L1 (objects ready of objects needed) and the reusable prefix."""
        return self._query(f)[0]

    def _query(self, f: dict[str, Any]) -> tuple[dict[str, Any], list[list[IKey]]]:
        hashes, per_chunk = self._query_keys(f)
        ready = self.l1.ready
        present = [sum(1 for k in keys if ready(k) is not None) for keys in per_chunk]
        chunks = [{"hash": h.hex(), "l1": n, "objects": len(keys)} for h, n, keys in zip(hashes, present, per_chunk)]
        hit = next((i for i, (n, keys) in enumerate(zip(present, per_chunk)) if n < len(keys)), len(chunks))
        result = {"chunks": chunks, "prefix_tokens": hit * self.chunk_size, "chunk_size": self.chunk_size}
        return result, per_chunk

    async def query_l2(self, f: dict[str, Any]) -> dict[str, Any]:
        """query, plus presence per L2 tier: `l2` when one tier is configured, `l2.<i>` for each of several.

        A tier that is down or slower than the prefetch timeout reports nothing for that query.
        """
        result, per_chunk = self._query(f)
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

    def set_pinned(self, f: dict[str, Any], pinned: bool) -> dict[str, Any]:
        ks, salt = self._ks(f["keyspace"]), f.get("salt", "")
        changed = 0
        for h in self._hashes(f, self._per_chunk(f)):
            for key in self._chunk_keys(ks, salt, h):
                changed += self.l1.set_pinned(key, pinned)
        return {"objects": changed}

    # -- store ---------------------------------------------------------------------------------
    def store(self, f: dict[str, Any]) -> dict[str, Any]:
        ks, salt, rank = self._ks(f["keyspace"]), f.get("salt", ""), f["rank"]
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
        start = f.get("start_chunk", 0)
        if start > len(hashes):
            raise _fail(ErrorCode.OUT_OF_RANGE, "start_chunk beyond the last full chunk")
        txn = StoreTxn(new_store_id(), f.get("mode", "shm"), f.get("session"), [],
                       self.table.deadline(), keyspace=ks, salt=salt, tokens=f["tokens"], hashes=hashes)
        reply_slots = []
        for chunk in range(start, len(hashes)):
            for group, key in enumerate(self._keys(ks, salt, rank, hashes[chunk])):
                existing = self.l1.entries.get(key)
                if existing is not None:
                    status = "present" if existing.state is State.READY else "writing"
                    self.counters.deduplicated_objects += 1
                    reply_slots.append({"chunk": chunk, "group": group, "status": status})
                    continue
                entry = self.l1.reserve(key, sizes[group])
                if entry is None:
                    self.counters.no_space += 1
                    reply_slots.append({"chunk": chunk, "group": group, "status": "no_space"})
                    continue
                txn.slots.append(Slot(key, chunk, group, entry))
                slot = {"chunk": chunk, "group": group, "status": "reserved", "size": entry.size}
                if txn.mode == "shm":
                    slot["offset"] = entry.offset
                reply_slots.append(slot)
        if txn.slots:
            self.table.stores[txn.id] = txn
        self.counters.stores += 1
        return {"store_id": txn.id if txn.slots else None, "slots": reply_slots}

    def commit(self, store_id: str, frames: list[memoryview], checksums: list[int]) -> dict[str, Any]:
        txn = self.table.stores.get(store_id)
        if txn is None:
            raise _fail(ErrorCode.UNKNOWN_STORE, f"unknown or expired store {store_id}")
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
            self.l1.finish_write(slot.key)
            self.counters.stored_bytes += slot.entry.size
        self.counters.stored_objects += len(txn.slots)
        keys = [s.key for s in txn.slots]
        for hook in self.on_commit:
            hook(keys)
        for txn_hook in self.on_commit_txn:
            txn_hook(txn)
        return {"committed": len(txn.slots)}

    def abort(self, store_id: str) -> dict[str, Any]:
        txn = self.table.stores.pop(store_id, None)
        if txn is None:
            raise _fail(ErrorCode.UNKNOWN_STORE, f"unknown or expired store {store_id}")
        self._abort_txn(txn)
        return {"aborted": len(txn.slots)}

    def _abort_txn(self, txn: StoreTxn) -> None:
        self.leases.end_write(txn)

    # -- retrieve ------------------------------------------------------------------------------
    def retrieve(self, f: dict[str, Any]) -> tuple[dict[str, Any], list[bytes]]:
        """Offsets (shm) or copies (tcp) of one rank's leased objects, and the reader's lease number.

        tcp frames are copies, never views of the arena: a frame may wait in ZMQ's queue after the
        lease ends, and a view would then send whatever object reuses the slot.
        """
        start, end, rank = f["start_chunk"], f["end_chunk"], f["rank"]
        reader = self.leases.reader(f["session"], rank)
        if not start <= end <= reader.hit_chunks:
            raise _fail(ErrorCode.NOT_LEASED, f"chunks [{start}, {end}) not within the leased prefix "
                                              f"of {reader.hit_chunks} chunks")
        mode = f.get("mode", "shm")
        objects, frames = [], []
        for chunk in range(start, end):
            for group, key in enumerate(self._keys(reader.keyspace, reader.salt, rank, reader.hashes[chunk])):
                entry = self.l1.entries[key]  # leased, so present and ready
                obj = {"chunk": chunk, "group": group, "size": entry.size, "checksum": entry.checksum}
                if mode == "shm":
                    obj["offset"] = entry.offset
                else:
                    frames.append(bytes(self.l1.arena.read(entry.offset, entry.size)))
                objects.append(obj)
                self.counters.retrieved_bytes += entry.size
        self.counters.retrieves += 1
        return {"objects": objects, "lease": reader.lease}, frames

    # -- sessions ------------------------------------------------------------------------------
    def release(self, f: dict[str, Any]) -> dict[str, Any]:
        """`{released, intact}`: see leases.Leases.release."""
        if "lease" in f and "rank" not in f:
            raise _fail(ErrorCode.BAD_FIELD, "release: lease needs rank")
        result = self.leases.release(f["session"], f.get("rank"), f.get("lease"))
        if "lease" in f and not result["intact"]:
            self.counters.broken_reads += 1
        return result

    def end_session(self, session_id: str) -> dict[str, Any]:
        released = self.leases.drop(session_id)
        aborted = 0
        for txn in [t for t in self.table.stores.values() if t.session == session_id]:
            del self.table.stores[txn.id]
            self._abort_txn(txn)
            aborted += 1
        return {"released": released, "aborted_stores": aborted}

    def expire(self, now: float | None = None) -> None:
        sessions, stores = self.leases.expire(now)
        self.counters.expired_sessions += sessions
        self.counters.expired_stores += stores

    def clear(self) -> dict[str, Any]:
        return {"removed": self.l1.clear()}
