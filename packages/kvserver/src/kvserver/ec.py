"""The encoder cache (EC): one encoder output per multimodal item, apart from the KV cache.

Why apart: an EC object is one tensor per image, request-scoped and written rarely; KV objects are
chunked, per layer and high-throughput. In one pool, hot KV would evict cold EC and neither budget
could be audited. So EC has its own shared-memory segment (`<arena>-ec`, its own byte budget,
`--ec-size-gb`, default 1 GiB), its own index, LRU eviction that never looks at KV, and its own
counters. The segment has the L1 arena's header (magic + instance nonce), so an engine that maps a
stale segment sees a different nonce and misses.

Keys are (model, space, item): see kvprotocol/_ec_messages.py. An object is WRITING (reserved,
invisible) until its commit, then READY. Reads in shm mode hold a lease (eviction skips leased
objects) until `ec_release` or the lease TTL; reservations that outlive the TTL are quarantined
like L1's, so a late writer can only scribble on memory nobody reads.
"""

from __future__ import annotations

import itertools
import os
import secrets
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from kvprotocol._requests import ECLookup, ECRetrieve, ECStore
from kvprotocol.kvsum import kvsum64

from .errors import BadField, OutOfRange, TooMany, UnknownStore
from .arena import HEADER_BYTES, SHM_DIR, Arena
from .ec_alloc import FirstFitAllocator

ECKey = tuple[str, str, str]  # (model, space, item)
MAX_EC_STORES = 1024  # reservations in flight
MAX_EC_LEASES = 1 << 16  # live read leases


def ec_arena_name(arena_name: str) -> str:
    return f"{arena_name}-ec"


def check_ec_space(name: str, size: int) -> None:
    """Refuse an EC segment /dev/shm cannot hold (a stale segment of the same name counts as free)."""
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    try:
        free += os.stat(SHM_DIR / name).st_blocks * 512
    except FileNotFoundError:
        pass
    if size > free:
        raise RuntimeError(f"--ec-size-gb needs {size / (1 << 30):.2f} GiB more in /dev/shm but only "
                           f"{free / (1 << 30):.2f} GiB is free; give the server more shared memory or "
                           "lower --ec-size-gb")


@dataclass(slots=True)
class ECEntry:
    offset: int
    size: int
    dtype: str
    shape: list[int]
    ready: bool = False
    checksum: int = 0
    leases: int = 0  # live lease ids on this object


@dataclass(slots=True)
class ECStoreTxn:
    key: ECKey
    mode: str
    expires: float


@dataclass(slots=True)
class ECLease:
    key: ECKey
    readers: int  # release calls still expected
    expires: float


@dataclass
class ECCounters:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    stores: int = 0
    stored_bytes: int = 0
    deduplicated: int = 0
    no_space: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    retrieves: int = 0
    retrieved_bytes: int = 0
    expired_stores: int = 0
    expired_leases: int = 0
    rejected_commits: int = 0  # tcp commits whose bytes did not match their checksum


class ECCache:
    """The EC namespace: index, allocator, leases and counters over its own segment."""

    def __init__(self, arena: Arena, lease_ttl: float) -> None:
        self.arena = arena
        self.lease_ttl = lease_ttl
        self.alloc = FirstFitAllocator(arena.capacity, base=HEADER_BYTES)
        self.entries: dict[ECKey, ECEntry] = {}
        self.lru: OrderedDict[ECKey, None] = OrderedDict()  # READY objects, least recently used first
        self.stores: dict[str, ECStoreTxn] = {}
        self.leases: dict[int, ECLease] = {}
        self._lease_ids = itertools.count(secrets.randbits(32) + 1)
        self._quarantine: deque[tuple[float, int]] = deque()  # (until, offset)
        self.counters = ECCounters()
        self.ready_bytes = 0  # kept incrementally: describe() and /metrics never scan the index

    # -- wire ----------------------------------------------------------------------------------
    def handlers(self) -> dict[str, Any]:
        return {
            "ec_lookup": lambda r, fr, w: (self.lookup(r), []),
            "ec_store": lambda r, fr, w: (self.store(r), []),
            "ec_commit": lambda r, fr, w: (self.commit(r.store_id, fr, r.checksum), []),
            "ec_abort": lambda r, fr, w: (self.abort(r.store_id), []),
            "ec_retrieve": lambda r, fr, w: self.retrieve(r),
            "ec_release": lambda r, fr, w: (self.release(r.lease), []),
            "ec_clear": lambda r, fr, w: (self.clear(), []),
        }

    def arena_info(self) -> dict[str, Any]:
        return {"name": self.arena.name, "size": self.arena.size, "nonce": self.arena.nonce}

    @staticmethod
    def _key(r: ECLookup | ECStore | ECRetrieve, item: str) -> ECKey:
        return (r.model, r.space, item)

    def _describe(self, e: ECEntry, lease: int | None) -> dict[str, Any]:
        out: dict[str, Any] = {"size": e.size, "dtype": e.dtype, "shape": e.shape, "checksum": e.checksum,
                               "offset": e.offset}
        if lease is not None:
            out["lease"] = lease
        return out

    # -- lookup --------------------------------------------------------------------------------
    def lookup(self, f: ECLookup) -> dict[str, Any]:
        """One answer per item: null (miss) or its descriptor; with readers, each hit leased."""
        readers = f.readers or 0
        if readers and len(self.leases) + len(f.items) > MAX_EC_LEASES:
            self.expire()
        out: list[dict[str, Any] | None] = []
        c = self.counters
        c.lookups += 1
        for item in f.items:
            key = self._key(f, item)
            e = self.entries.get(key)
            if e is None or not e.ready:
                c.misses += 1
                out.append(None)
                continue
            lease = None
            if readers:
                if len(self.leases) >= MAX_EC_LEASES:  # cannot protect it until the read: call it a miss
                    c.misses += 1
                    out.append(None)
                    continue
                lease = self._lease(key, e, readers)
            c.hits += 1
            self.lru.move_to_end(key)
            out.append(self._describe(e, lease))
        return {"items": out, "arena": self.arena_info()}

    def _lease(self, key: ECKey, e: ECEntry, readers: int) -> int:
        lease = next(self._lease_ids)
        self.leases[lease] = ECLease(key, readers, time.monotonic() + self.lease_ttl)
        e.leases += 1
        return lease

    # -- store ---------------------------------------------------------------------------------
    def store(self, f: ECStore) -> dict[str, Any]:
        key, size, mode = self._key(f, f.item), f.size, f.mode
        if size == 0:
            raise OutOfRange("an encoder output has at least one byte")
        existing = self.entries.get(key)
        if existing is not None:
            self.counters.deduplicated += 1
            return {"status": "present" if existing.ready else "writing"}
        if len(self.stores) >= MAX_EC_STORES:
            self.expire()
        if len(self.stores) >= MAX_EC_STORES:
            raise TooMany(f"{MAX_EC_STORES} EC stores are in flight; commit or abort some first")
        offset = self._reserve(size)
        if offset is None:
            self.counters.no_space += 1
            return {"status": "no_space"}
        self.entries[key] = ECEntry(offset, size, f.dtype, list(f.shape))
        store_id = secrets.token_hex(16)
        self.stores[store_id] = ECStoreTxn(key, mode, time.monotonic() + self.lease_ttl)
        reply: dict[str, Any] = {"status": "reserved", "store_id": store_id, "size": size}
        if mode == "shm":
            reply["offset"] = offset
            reply["arena"] = self.arena_info()
        return reply

    def _reserve(self, size: int) -> int | None:
        """Allocate, evicting least recently used unleased objects of this namespace as needed."""
        if size > self.alloc.capacity:
            return None
        offset = self.alloc.alloc(size)
        while offset is None:
            victim = next((k for k in self.lru if self.entries[k].leases == 0), None)
            if victim is None:
                return None
            e = self._drop(victim)
            self.counters.evictions += 1
            self.counters.evicted_bytes += e.size
            offset = self.alloc.alloc(size)
        return offset

    def commit(self, store_id: str, frames: list[memoryview], checksum: int) -> dict[str, Any]:
        txn = self.stores.get(store_id)
        if txn is None or txn.expires <= time.monotonic():
            if txn is not None:
                self._expire_store(store_id)
            raise UnknownStore(f"unknown or expired EC store {store_id}")
        e = self.entries[txn.key]
        if txn.mode == "tcp":
            if len(frames) != 1 or frames[0].nbytes != e.size:
                raise BadField(f"ec_commit in tcp mode takes one frame of {e.size} bytes")
            if kvsum64(frames[0]) != checksum:  # bad bytes never enter: the store stays open for a retry
                self.counters.rejected_commits += 1
                raise BadField("ec_commit: the frame does not match its checksum")
            self.arena.write(e.offset, frames[0])
        elif frames:
            raise BadField("ec_commit in shm mode takes no data frames")
        del self.stores[store_id]
        e.ready, e.checksum = True, checksum
        self.lru[txn.key] = None
        self.ready_bytes += e.size
        self.counters.stores += 1
        self.counters.stored_bytes += e.size
        return {"committed": True}

    def abort(self, store_id: str) -> dict[str, Any]:
        if store_id not in self.stores:
            raise UnknownStore(f"unknown or expired EC store {store_id}")
        self._expire_store(store_id)
        return {"aborted": True}

    def _expire_store(self, store_id: str) -> None:
        """Drop a reservation; its slot stays allocated one more TTL (a late writer may still copy)."""
        txn = self.stores.pop(store_id)
        e = self.entries.pop(txn.key)
        self._quarantine.append((time.monotonic() + self.lease_ttl, e.offset))

    # -- retrieve ------------------------------------------------------------------------------
    def retrieve(self, f: ECRetrieve) -> tuple[dict[str, Any], list[Any]]:
        """tcp: the bytes as one frame (a copy); shm: the offset, leased for one reader."""
        key, mode = self._key(f, f.item), f.mode
        e = self.entries.get(key)
        c = self.counters
        if e is None or not e.ready:
            c.misses += 1
            return {"found": False}, []
        c.hits += 1
        c.retrieves += 1
        c.retrieved_bytes += e.size
        self.lru.move_to_end(key)
        if mode == "tcp":
            return {"found": True, **self._describe(e, None)}, [bytes(self.arena.read(e.offset, e.size))]
        if len(self.leases) >= MAX_EC_LEASES:
            self.expire()
        if len(self.leases) >= MAX_EC_LEASES:
            raise TooMany(f"{MAX_EC_LEASES} EC leases are live; release some first")
        return {"found": True, **self._describe(e, self._lease(key, e, 1)), "arena": self.arena_info()}, []

    def release(self, lease_id: int) -> dict[str, Any]:
        """One reader is done; the lease ends when all its readers are (or at its TTL)."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return {"released": False}
        lease.readers -= 1
        if lease.readers <= 0:
            self._end_lease(lease_id)
        return {"released": True}

    def _end_lease(self, lease_id: int) -> None:
        lease = self.leases.pop(lease_id)
        e = self.entries.get(lease.key)
        if e is not None and e.leases > 0:
            e.leases -= 1

    # -- housekeeping --------------------------------------------------------------------------
    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for sid in [s for s, t in self.stores.items() if t.expires <= now]:
            self._expire_store(sid)
            self.counters.expired_stores += 1
        for lid in [i for i, lease in self.leases.items() if lease.expires <= now]:
            self._end_lease(lid)
            self.counters.expired_leases += 1
        while self._quarantine and self._quarantine[0][0] <= now:
            self.alloc.free(self._quarantine.popleft()[1])

    def clear(self) -> dict[str, Any]:
        """Remove every ready, unleased object."""
        doomed = [k for k, e in self.entries.items() if e.ready and e.leases == 0]
        for key in doomed:
            self._drop(key)
        return {"removed": len(doomed)}

    def _drop(self, key: ECKey) -> ECEntry:
        e = self.entries.pop(key)
        if e.ready:
            self.lru.pop(key, None)
            self.ready_bytes -= e.size
        self.alloc.free(e.offset)
        return e

    def describe(self) -> dict[str, Any]:
        ready = len(self.lru)
        return {
            "capacity_bytes": self.arena.capacity,
            "used_bytes": self.alloc.used_bytes,
            "objects": ready,
            "object_bytes": self.ready_bytes,
            "writing": len(self.entries) - ready,
            "leases": len(self.leases),
            "quarantined": len(self._quarantine),
            "arena": self.arena.name,
            "counters": vars(self.counters),
        }
