"""The encoder cache (EC): one encoder output per multimodal item, apart from the KV cache.

Why apart: an EC object is one tensor per image, request-scoped and written rarely; KV objects are
chunked, per layer and high-throughput. In one pool, hot KV would evict cold EC and neither budget
could be audited. So EC has its own shared-memory segment (`<arena>-ec`, its own byte budget,
`--ec-size-gb`, default 1 GiB), its own index, LRU eviction that never looks at KV, and its own
counters. The segment has the L1 arena's header (magic + instance nonce), so an engine that maps a
stale segment sees a different nonce and misses.

Keys are (tenant, model, space, item): the client names (model, space, item) (see
kvprotocol/_ec_messages.py) and the server puts it under the tenant its token is, so one tenant's
item X and another's are different objects (no tenant reads, or pre-empts the store of, another's
item). An object is WRITING (reserved, invisible) until its commit, then READY. Reads in shm mode
hold a lease (eviction skips leased objects) until `ec_release` or the lease TTL; lease and store
ids are 128 random bits and belong to the tenant that got them (another tenant's id is unknown).
Reservations that outlive the TTL are quarantined like L1's, so a late writer can only scribble on
memory nobody reads. Per-tenant quota, fair share and caps: ec_tenants.py.
"""

from __future__ import annotations

import os
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvprotocol._replies import (
    ArenaInfo,
    ClearReply,
    ECAbortReply,
    ECCommitReply,
    ECLookupReply,
    ECObject,
    ECReleaseReply,
    ECRetrieveReply,
    ECStoreReply,
)
from kvprotocol._requests import ECLookup, ECRetrieve, ECStore
from kvprotocol.kvsum import kvsum64

from ..errors import BadField, Forbidden, OutOfRange, TooMany, UnknownStore
from ..l1.arena import HEADER_BYTES, SHM_DIR, Arena
from ..l1.journal import ArenaJournal
from .alloc import FirstFitAllocator
from .journal import ECCommitted
from .tenants import ECTenants
from ..security.shm import arena_for
from ..security.tenants import ADMIN, Identity, TenantBook

ECKey = tuple[str, str, str, str]  # (tenant, model, space, item): key[0] owns the object
MAX_EC_STORES = 1024  # reservations in flight, all tenants together
MAX_EC_LEASES = 1 << 16  # live read leases, all tenants together
SWEEP_INTERVAL = 0.05  # seconds between expiry sweeps a refusal at a cap may trigger


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
        raise RuntimeError(
            f"--ec-size-gb needs {size / (1 << 30):.2f} GiB more in /dev/shm but only "
            f"{free / (1 << 30):.2f} GiB is free; give the server more shared memory or "
            "lower --ec-size-gb"
        )


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

    def __init__(self, arena: Arena, lease_ttl: float, tenants: TenantBook | None = None) -> None:
        self.arena = arena
        self.lease_ttl = lease_ttl
        self.alloc = FirstFitAllocator(arena.capacity, base=HEADER_BYTES)
        self.entries: dict[ECKey, ECEntry] = {}
        self.lru: dict[str, OrderedDict[ECKey, None]] = {}  # per tenant: READY objects, least recent first
        self.stores: dict[str, ECStoreTxn] = {}
        self.leases: dict[str, ECLease] = {}
        self._quarantine: deque[tuple[float, int, str, int]] = deque()  # (until, offset, tenant, size)
        self.tenants = ECTenants(arena.capacity, tenants, (MAX_EC_STORES, MAX_EC_LEASES))
        self._swept = 0.0  # when expire() last ran
        self.counters = ECCounters()
        self.ready_bytes = 0  # kept incrementally: describe() and /metrics never scan the index
        self.journal: ArenaJournal[ECCommitted] | None = None  # ready objects, for a warm restart (journal.py)

    # -- wire ----------------------------------------------------------------------------------
    def handlers(self) -> dict[str, Any]:
        return {
            "ec_lookup": lambda r, fr, w: (self.lookup(r, w), []),
            "ec_store": lambda r, fr, w: (self.store(r, w), []),
            "ec_commit": lambda r, fr, w: (self.commit(r.store_id, fr, r.checksum, w), []),
            "ec_abort": lambda r, fr, w: (self.abort(r.store_id, w), []),
            "ec_retrieve": lambda r, fr, w: self.retrieve(r, w),
            "ec_release": lambda r, fr, w: (self.release(r.lease, w), []),
            "ec_clear": lambda r, fr, w: (self.clear(), []),
        }

    def arena_info(self) -> ArenaInfo:
        return ArenaInfo(name=self.arena.name, size=self.arena.size, nonce=self.arena.nonce)

    @staticmethod
    def _key(r: ECLookup | ECStore | ECRetrieve, item: str, who: Identity) -> ECKey:
        return (who.tenant, r.model, r.space, item)

    def _lru(self, tenant: str) -> OrderedDict[ECKey, None]:
        lru = self.lru.get(tenant)
        if lru is None:
            lru = self.lru[tenant] = OrderedDict()
        return lru

    def _describe(self, e: ECEntry, lease: str | None, who: Identity) -> ECObject:
        # an offset is only of use to (and only told to) a client that maps the segment
        return ECObject(e.size, e.dtype, e.shape, e.checksum, e.offset if who.shm else None, lease)

    # -- lookup --------------------------------------------------------------------------------
    def lookup(self, f: ECLookup, who: Identity = ADMIN) -> ECLookupReply:
        """One answer per item: null (miss) or its descriptor; with readers, each hit leased."""
        readers = f.readers or 0
        usage, cap = self.tenants.of(who.tenant), self.tenants.limits(who.tenant)[2]
        if readers and (len(self.leases) + len(f.items) > MAX_EC_LEASES or usage.leases + len(f.items) > cap):
            self._sweep()
        out: list[ECObject | None] = []
        c = self.counters
        c.lookups += 1
        lru = self._lru(who.tenant)
        for item in f.items:
            key = self._key(f, item, who)
            e = self.entries.get(key)
            if e is None or not e.ready:
                c.misses += 1
                out.append(None)
                continue
            lease = None
            if readers:
                if len(self.leases) >= MAX_EC_LEASES or usage.leases >= cap:  # cannot protect it: a miss
                    usage.refused_leases += 1
                    c.misses += 1
                    out.append(None)
                    continue
                lease = self._lease(key, e, readers)
            c.hits += 1
            lru.move_to_end(key)
            out.append(self._describe(e, lease, who))
        return ECLookupReply(out, arena_for(who, self.arena_info()))

    def _lease(self, key: ECKey, e: ECEntry, readers: int) -> str:
        lease = secrets.token_urlsafe(16)  # 128 random bits: not guessable, and owned by key[0]
        self.leases[lease] = ECLease(key, readers, time.monotonic() + self.lease_ttl)
        e.leases += 1
        self.tenants.of(key[0]).leases += 1
        return lease

    # -- store ---------------------------------------------------------------------------------
    def store(self, f: ECStore, who: Identity = ADMIN) -> ECStoreReply:
        key, size, mode = self._key(f, f.item, who), f.size, f.mode
        if size == 0:
            raise OutOfRange("an encoder output has at least one byte")
        existing = self.entries.get(key)
        if existing is not None:  # the tenant's own object: another tenant's item X is another key
            self.counters.deduplicated += 1
            return ECStoreReply("present" if existing.ready else "writing")
        usage, cap = self.tenants.of(who.tenant), self.tenants.limits(who.tenant)[1]
        if len(self.stores) >= MAX_EC_STORES or usage.stores >= cap:
            self._sweep()
        if usage.stores >= cap:
            usage.refused_stores += 1
            raise TooMany(f"tenant {who.tenant!r} has {cap} EC stores in flight; commit or abort some first")
        if len(self.stores) >= MAX_EC_STORES:
            raise TooMany(f"{MAX_EC_STORES} EC stores are in flight; commit or abort some first")
        offset = self._reserve(size, who.tenant)
        if offset is None:
            self.counters.no_space += 1
            return ECStoreReply("no_space")
        self.entries[key] = ECEntry(offset, size, f.dtype, list(f.shape))
        usage.used_bytes += size
        usage.stores += 1
        store_id = secrets.token_hex(16)
        self.stores[store_id] = ECStoreTxn(key, mode, time.monotonic() + self.lease_ttl)
        if mode == "shm":
            return ECStoreReply("reserved", store_id, size, offset, self.arena_info())
        return ECStoreReply("reserved", store_id, size)

    def _reserve(self, size: int, tenant: str) -> int | None:
        """Allocate within the tenant's quota (evicting its own LRU unleased objects), then within the
        segment (evicting objects of tenants over their fair share, then its own); see ec_tenants.py."""
        usage, quota = self.tenants.of(tenant), self.tenants.limits(tenant)[0]
        if size > self.alloc.capacity or (quota is not None and size > quota):
            usage.quota_refusals += quota is not None and size > quota
            return None
        while quota is not None and usage.used_bytes + size > quota:
            if not self._evict_lru(tenant):
                usage.quota_refusals += 1
                return None
            usage.quota_evictions += 1
        offset = self.alloc.alloc(size)
        while offset is None:
            if not self._evict_for(tenant):
                return None
            offset = self.alloc.alloc(size)
        return offset

    def _evict_for(self, tenant: str) -> bool:
        """Evict one object to make room in the segment for a store of `tenant`."""
        for other in self.tenants.over_fair_share(tenant):
            if self._evict_lru(other):
                self.tenants.of(other).fair_share_evictions += 1
                return True
        return self._evict_lru(tenant)

    def _evict_lru(self, tenant: str) -> bool:
        """Evict the tenant's least recently used unleased object; False when it has none."""
        victim = next((k for k in self.lru.get(tenant, ()) if self.entries[k].leases == 0), None)
        if victim is None:
            return False
        e = self._drop(victim)
        self.counters.evictions += 1
        self.counters.evicted_bytes += e.size
        return True

    def _owned_store(self, store_id: str, who: Identity) -> ECStoreTxn:
        """The caller's own store; another tenant's id is unknown, the same answer as one never made."""
        txn = self.stores.get(store_id)
        if txn is None or txn.key[0] != who.tenant:
            raise UnknownStore(f"unknown or expired EC store {store_id}")
        return txn

    def commit(self, store_id: str, frames: list[memoryview], checksum: int, who: Identity = ADMIN) -> ECCommitReply:
        txn = self._owned_store(store_id, who) if store_id in self.stores else None
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
        elif not who.shm:  # shm taken away since the store began: the slot holds no bytes of this tenant's
            raise Forbidden(f"tenant {who.tenant!r} may no longer commit an shm-mode EC store; store over tcp")
        del self.stores[store_id]
        self.tenants.of(txn.key[0]).stores -= 1
        e.checksum = checksum
        self._make_ready(txn.key, e)
        self.counters.stores += 1
        self.counters.stored_bytes += e.size
        return ECCommitReply(True)

    def abort(self, store_id: str, who: Identity = ADMIN) -> ECAbortReply:
        self._owned_store(store_id, who)
        self._expire_store(store_id)
        return ECAbortReply(True)

    def _expire_store(self, store_id: str) -> None:
        """Drop a reservation; its slot stays allocated one more TTL (a late writer may still copy),
        charged to its tenant until then (else reserve-and-abort would fill the segment past any quota)."""
        txn = self.stores.pop(store_id)
        tenant = txn.key[0]
        self.tenants.of(tenant).stores -= 1
        e = self.entries.pop(txn.key)
        self._quarantine.append((time.monotonic() + self.lease_ttl, e.offset, tenant, e.size))

    # -- retrieve ------------------------------------------------------------------------------
    def retrieve(self, f: ECRetrieve, who: Identity = ADMIN) -> tuple[ECRetrieveReply, list[Any]]:
        """tcp: the bytes as one frame (a copy); shm: the offset, leased for one reader."""
        key, mode = self._key(f, f.item, who), f.mode
        e = self.entries.get(key)
        c = self.counters
        if e is None or not e.ready:
            c.misses += 1
            return ECRetrieveReply(False), []
        c.hits += 1
        c.retrieves += 1
        c.retrieved_bytes += e.size
        self._lru(who.tenant).move_to_end(key)
        if mode == "tcp":
            return self._found(self._describe(e, None, who), None), [bytes(self.arena.read(e.offset, e.size))]
        usage, cap = self.tenants.of(who.tenant), self.tenants.limits(who.tenant)[2]
        if len(self.leases) >= MAX_EC_LEASES or usage.leases >= cap:
            self._sweep()
        if usage.leases >= cap:
            usage.refused_leases += 1
            raise TooMany(f"tenant {who.tenant!r} holds {cap} EC leases; release some first")
        if len(self.leases) >= MAX_EC_LEASES:
            raise TooMany(f"{MAX_EC_LEASES} EC leases are live; release some first")
        return self._found(self._describe(e, self._lease(key, e, 1), who), self.arena_info()), []

    @staticmethod
    def _found(o: ECObject, arena: ArenaInfo | None) -> ECRetrieveReply:
        return ECRetrieveReply(True, o.size, o.dtype, o.shape, o.checksum, o.offset, o.lease, arena)

    def release(self, lease_id: str, who: Identity = ADMIN) -> ECReleaseReply:
        """One reader is done; the lease ends when all its readers are (or at its TTL). Another
        tenant's lease id is unknown: it releases nothing, the same answer as an id never handed out."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.key[0] != who.tenant:
            return ECReleaseReply(False)
        lease.readers -= 1
        if lease.readers <= 0:
            self._end_lease(lease_id)
        return ECReleaseReply(True)

    def _end_lease(self, lease_id: str) -> None:
        lease = self.leases.pop(lease_id)
        self.tenants.of(lease.key[0]).leases -= 1
        e = self.entries.get(lease.key)
        if e is not None and e.leases > 0:
            e.leases -= 1

    # -- housekeeping --------------------------------------------------------------------------
    def _sweep(self) -> None:
        """Expire before refusing at a cap, at most every SWEEP_INTERVAL: a tenant that sits at its cap
        cannot make every one of its requests scan all leases and stores (the expiry loop runs anyway)."""
        now = time.monotonic()
        if now - self._swept >= SWEEP_INTERVAL:
            self.expire(now)

    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._swept = now
        for sid in [s for s, t in self.stores.items() if t.expires <= now]:
            self._expire_store(sid)
            self.counters.expired_stores += 1
        for lid in [i for i, lease in self.leases.items() if lease.expires <= now]:
            self._end_lease(lid)
            self.counters.expired_leases += 1
        while self._quarantine and self._quarantine[0][0] <= now:
            _, offset, tenant, size = self._quarantine.popleft()
            self.alloc.free(offset)
            self.tenants.of(tenant).used_bytes -= size
        if self.journal is not None and self.journal.due():
            self.journal.compact(self.ready_records())

    def clear(self) -> ClearReply:
        """Remove every ready, unleased object."""
        doomed = [k for k, e in self.entries.items() if e.ready and e.leases == 0]
        for key in doomed:
            self._drop(key)
        return ClearReply(len(doomed))

    def _make_ready(self, key: ECKey, e: ECEntry) -> None:
        e.ready = True
        self._lru(key[0])[key] = None
        self.ready_bytes += e.size
        if self.journal is not None:
            self.journal.commit(self._record(key, e))

    @staticmethod
    def _record(key: ECKey, e: ECEntry) -> ECCommitted:
        return ECCommitted(key, e.offset, e.size, e.checksum, e.dtype, tuple(e.shape))

    def ready_records(self) -> Iterator[ECCommitted]:
        return (self._record(k, e) for k, e in self.entries.items() if e.ready)

    # -- warm restart ----------------------------------------------------------------------------
    def adopt(self, found: list[ECCommitted], keep: Callable[[str], bool]) -> list[ECKey]:
        """Take back the ranges of a previous server's ready objects, as invisible (not ready) entries
        charged to their tenants, until `finish_adopt` says their bytes passed their checksum. A record
        that overlaps another, lies outside the segment, or whose tenant `keep` refuses is dropped."""
        adopted: list[ECKey] = []
        for c in sorted(found, key=lambda c: c.offset):
            if c.key in self.entries or not keep(c.key[0]) or not self.alloc.take(c.offset, c.size):
                continue
            self.entries[c.key] = ECEntry(c.offset, c.size, c.dtype, list(c.shape), checksum=c.checksum)
            self.tenants.of(c.key[0]).used_bytes += c.size
            adopted.append(c.key)
        return adopted

    def finish_adopt(self, key: ECKey, verified: bool) -> None:
        """An adopted object's bytes were checked: ready (and journaled again) if they passed, else freed."""
        e = self.entries.get(key)
        if e is None or e.ready or any(t.key == key for t in self.stores.values()):
            return
        if verified:
            self._make_ready(key, e)
        else:
            self._drop(key)

    def _drop(self, key: ECKey) -> ECEntry:
        e = self.entries.pop(key)
        if e.ready:
            self._lru(key[0]).pop(key, None)
            self.ready_bytes -= e.size
            if self.journal is not None:
                self.journal.free(e.offset)  # before the range can be handed out again
        self.alloc.free(e.offset)
        self.tenants.of(key[0]).used_bytes -= e.size
        return e

    def describe(self) -> dict[str, Any]:
        ready = sum(len(lru) for lru in self.lru.values())
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
