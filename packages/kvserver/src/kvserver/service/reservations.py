"""Whole-request reservations: a producer's request is admitted only when all of its chunks fit.

Why (docs/pd.md): a prefill engine (kv_producer) stores a long prompt chunk by chunk. Admitted one
store at a time, two such requests in a full arena each get part of the room and then fight over the
rest (each evicts the other's prefix, or both sit half-written): neither consumer finds a whole
prefix. A reservation books the request's total bytes (chunks x groups x ranks) at its first store;
a request that does not fit now gets RETRY_LATER and takes nothing, so requests complete in turn.

Accounting, all in arena slot bytes:
* `need`: what the reservation booked; `drawn`: what its stores have taken so far (allocated slots,
  and objects that were already present); `outstanding = need - drawn` is kept free for it.
* Room for a new reservation (or a plain store while reservations are outstanding) is the capacity
  minus what cannot be evicted (writing, leased, pinned, quarantined) minus every outstanding booking.
* Its ready objects (committed, or present before) stay leased to it until it completes: another
  admission must not evict the first half of a request to make room for itself.
* A protocol violation (no total on a first store, a different total later, chunks beyond the total)
  rolls the reservation back: its open stores are aborted, its committed objects dropped (unless a
  reader holds them), the booking released.

Bounds, so a booking is never free (a producer that books and writes nothing would otherwise keep
room from everyone else): a tenant's live reservations together book at most its cap (ledger.py
`reservation_cap`: a share of L1, within its quota); a reservation is rolled back one lease TTL
after its last progress (a commit; a store still open counts as work in progress, an empty store
does not) and, whatever it does, at its maximum lifetime.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvprotocol import KeySpace, ObjectKey

from ..errors import BadField, NoSpace, RetryLater
from ..l1.cache import L1Cache, State, tenant_of

ChunkRef = tuple[str, int, str, bytes]  # (model, world_size, salt, chunk hash): a chunk of any rank or group


@dataclass
class Reservation:
    id: str  # scoped (tenant NUL id)
    owner: str  # tenant
    total_chunks: int
    need: int  # slot bytes booked: total_chunks x world_size x sum of group slot sizes
    expires: float  # idle deadline: moved by commits only
    deadline: float  # the maximum lifetime's end: never moved
    drawn: int = 0
    covered: set[tuple[int, int]] = field(default_factory=set)  # (chunk, rank) a store of it reached
    objects: int = 0  # total_chunks x world_size: complete when covered reaches it
    charged: set[ObjectKey] = field(default_factory=set)  # objects drawn on the booking (each once)
    keys: list[ObjectKey] = field(default_factory=list)  # objects it allocated (committed or not)
    held: list[ObjectKey] = field(default_factory=list)  # ready objects it leases until it completes
    stores: set[str] = field(default_factory=set)  # its open store transactions
    chunks: set[ChunkRef] = field(default_factory=set)  # chunks it is writing: lookups report them in flight
    frontier: ChunkRef | None = None  # the last chunk stored so far: its continuation is coming

    @property
    def outstanding(self) -> int:
        return max(0, self.need - self.drawn)


class ReservationBook:
    def __init__(self, l1: L1Cache, ttl: float, lifetime: float = 300.0) -> None:
        self.l1 = l1
        self.ttl = ttl  # idle: rolled back this long after its last commit
        self.lifetime = lifetime  # rolled back this long after admission, progress or not
        self.live: dict[str, Reservation] = {}
        self.by_chunk: dict[ChunkRef, str] = {}  # chunk -> reservation writing it
        self.frontiers: dict[ChunkRef, str] = {}  # last stored chunk -> its incomplete reservation
        self.admitted = 0
        self.retry_later = 0
        self.rolled_back = 0
        self.completed = 0
        self.abort_stores: Callable[[Iterable[str]], None] = lambda ids: None  # set by the cache service
        self.cap_of: Callable[[str], int] = lambda tenant: l1.alloc.capacity  # a tenant's booking cap (ledger)
        self.on_refused: Callable[[str], None] = lambda tenant: None  # count a refusal at that cap (ledger)

    # -- accounting ------------------------------------------------------------------------------
    def outstanding(self, exclude: str | None = None, tenant: str | None = None) -> int:
        return sum(
            r.outstanding for r in self.live.values() if r.id != exclude and (tenant is None or r.owner == tenant)
        )

    def booked(self, tenant: str) -> int:
        """Bytes a tenant's live reservations book (drawn or not): what its cap bounds."""
        return sum(r.need for r in self.live.values() if r.owner == tenant)

    def pinned_bytes(self, tenant: str | None = None) -> int:
        """Bytes eviction cannot free now: writing, leased or pinned objects, and quarantined slots."""
        slot = self.l1.alloc.slot_size
        total = 0 if tenant is not None else self.l1.quarantined_bytes
        for key, e in self.l1.entries.items():
            if (e.state is State.WRITING or e.leases or e.pinned) and (tenant is None or tenant_of(key) == tenant):
                total += slot(e.size)
        return total

    def headroom(self, exclude: str | None = None) -> int:
        """Bytes a plain store (or a new reservation) may still take without eating into bookings."""
        return self.l1.alloc.capacity - self.pinned_bytes() - self.outstanding(exclude)

    def describe(self) -> dict[str, int]:
        """Live reservations, bytes still booked, and what happened to reservations so far."""
        return {
            "live": len(self.live),
            "outstanding_bytes": self.outstanding(),
            "admitted": self.admitted,
            "retry_later": self.retry_later,
            "completed": self.completed,
            "rolled_back": self.rolled_back,
        }

    # -- admission -------------------------------------------------------------------------------
    def admit(
        self, rid: str, owner: str, total_chunks: int | None, need_per_chunk: int, ranks: int, quota: int | None
    ) -> Reservation:
        """The live reservation `rid`, or a new one when all of its bytes fit (RETRY_LATER if not now)."""
        res = self.live.get(rid)
        if res is not None:
            if res.owner != owner:  # scoped ids make this unreachable; kept as a guard
                raise BadField("reservation belongs to another tenant")
            if total_chunks is not None and total_chunks != res.total_chunks:
                self.violation(res, f"total_chunks changed from {res.total_chunks} to {total_chunks}")
            return res  # a store alone is no progress: only its commit renews the reservation
        if total_chunks is None:
            raise BadField("the first store of a reservation must declare total_chunks")
        need = total_chunks * need_per_chunk
        cap = self.l1.alloc.capacity if quota is None else min(quota, self.l1.alloc.capacity)
        if need > cap:
            raise NoSpace(f"the request needs {need} bytes; L1 (or the tenant's quota) holds {cap}")
        tenant_cap = self.cap_of(owner)
        if need > tenant_cap:
            self.on_refused(owner)
            raise NoSpace(f"the request needs {need} bytes; tenant {owner!r} may book {tenant_cap} bytes at most")
        if self.booked(owner) + need > tenant_cap:
            self.on_refused(owner)
            self.retry_later += 1
            raise RetryLater(
                f"tenant {owner!r}'s reservations in flight and this request's {need} bytes are over its "
                f"{tenant_cap} bytes; retry after one completes"
            )
        fits = need <= self.headroom()
        if fits and quota is not None:
            fits = need <= quota - self.pinned_bytes(owner) - self.outstanding(tenant=owner)
        if not fits:
            self.retry_later += 1
            raise RetryLater(
                f"the request's {need} bytes do not fit next to the requests in flight; retry after one completes"
            )
        now = time.monotonic()
        res = Reservation(
            rid, owner, total_chunks, need, now + self.ttl, now + self.lifetime, objects=total_chunks * ranks
        )
        self.live[rid] = res
        self.admitted += 1
        return res

    def for_store(
        self,
        rid: str,
        owner: str,
        total_chunks: int | None,
        sizes: list[int],
        ks: KeySpace,
        salt: str,
        rank: int,
        hashes: list[bytes],
        start: int,
        quota: int | None,
    ) -> Reservation:
        """The reservation a store draws on (admitted now if new); chunks below start_chunk, which the
        producer found cached, count as covered."""
        slots = sum(self.l1.alloc.slot_size(n) for n in sizes)
        res = self.admit(rid, owner, total_chunks, slots * ks[1], ks[1], quota)
        self.check_range(res, len(hashes))
        model, world, groups = ks
        for chunk in range(min(start, len(hashes))):  # the producer found these cached: held as they are
            ref = (model, world, salt, hashes[chunk])
            for group, fp in enumerate(groups):
                key = ObjectKey(model, fp, world, rank, group, salt, hashes[chunk])
                if self.l1.entries.get(key) is not None:
                    self.draw(res, sizes[group], key, False, ref)
        self.cover(res, rank, 0, min(start, len(hashes)))
        return res

    def check_range(self, res: Reservation, end_chunk: int) -> None:
        if end_chunk > res.total_chunks:
            self.violation(res, f"store reaches chunk {end_chunk}, beyond the declared total of {res.total_chunks}")

    def violation(self, res: Reservation, message: str) -> None:
        """Roll the reservation back and refuse the store that broke the protocol."""
        self.rollback(res)
        raise BadField(f"reservation rolled back: {message}")

    # -- drawing ---------------------------------------------------------------------------------
    def draw(self, res: Reservation, size: int, key: ObjectKey, allocated: bool, ref: ChunkRef) -> None:
        """Charge one object (allocated now, or already present) to the reservation. With per-group
        geometry (groups.py) some groups skip some chunks: the booking is then an upper bound."""
        if key in res.charged:
            return
        res.charged.add(key)
        res.drawn += self.l1.alloc.slot_size(size)
        if allocated:
            res.keys.append(key)
        elif self.l1.ready(key) is not None:
            self.hold(res, [key])
        if ref not in res.chunks:
            res.chunks.add(ref)
            self.by_chunk.setdefault(ref, res.id)

    def cover(self, res: Reservation, rank: int, start: int, end: int) -> None:
        """A store by `rank` reached chunks [start, end) (whatever it found there)."""
        res.covered.update((c, rank) for c in range(start, end))

    def hold(self, res: Reservation, keys: list[ObjectKey]) -> None:
        """Lease ready objects to the reservation until it ends (committed ones, at their commit)."""
        for key in keys:
            self.l1.lease(key)
        res.held.extend(keys)

    def advance(self, res: Reservation, ref: ChunkRef | None) -> None:
        """The store reached chunk `ref`: lookups stopping right after it are told the rest is coming."""
        if res.frontier is not None and self.frontiers.get(res.frontier) == res.id:
            del self.frontiers[res.frontier]
        res.frontier = ref
        if ref is not None:
            self.frontiers[ref] = res.id

    def settle(self, res: Reservation, store_id: str | None) -> None:
        """A store of the reservation ended (`store_id`: committed, which renews its idle deadline;
        None: a store call returned); complete it once every object is covered."""
        if store_id is not None:
            res.stores.discard(store_id)
            res.expires = time.monotonic() + self.ttl
        if not res.stores and len(res.covered) >= res.objects:
            self._forget(res)
            self.completed += 1

    def inflight(self, refs: list[ChunkRef], hit: int) -> bool:
        """Whether the chunk a lookup stopped at is being written by a reservation in progress."""
        if hit >= len(refs):
            return False
        if refs[hit] in self.by_chunk:
            return True
        return hit > 0 and refs[hit - 1] in self.frontiers

    # -- ending ----------------------------------------------------------------------------------
    def rollback(self, res: Reservation) -> None:
        """Release the booking, abort its open stores, drop the objects it committed (unless leased)."""
        self._forget(res)
        self.rolled_back += 1
        stores, res.stores = sorted(res.stores), set()
        self.abort_stores(stores)
        for key in res.keys:
            e = self.l1.entries.get(key)
            if e is not None and e.state is State.READY and not e.leases:
                self.l1.remove(key)

    def expired(self, now: float, is_open: Callable[[str], bool]) -> list[Reservation]:
        """Reservations past their lifetime, or idle past their deadline with no store still open."""
        return [
            r
            for r in self.live.values()
            if r.deadline <= now or (r.expires <= now and not any(is_open(sid) for sid in r.stores))
        ]

    def _forget(self, res: Reservation) -> None:
        self.live.pop(res.id, None)
        held, res.held = res.held, []
        for key in held:
            self.l1.unlease(key)
        for ref in res.chunks:
            if self.by_chunk.get(ref) == res.id:
                del self.by_chunk[ref]
        self.advance(res, None)
