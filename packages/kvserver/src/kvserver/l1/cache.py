"""The L1 object index over the arena: states, leases, pins and eviction.

An object is WRITING (reserved, invisible to readers) or READY. Eviction never takes an object that
is writing, read-leased or pinned; when nothing can be evicted, `reserve` returns None and the
caller answers "no space" instead of blocking.

Slots of writes that may still be in flight (a client reservation that expired or was aborted)
are quarantined: the key leaves the index at once, but the slot stays allocated until the
quarantine ends, so a late writer can only scribble on memory nobody reads.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvprotocol import ObjectKey

from .arena import HEADER_BYTES, Arena
from .eviction import EvictionPolicy
from .journal import ArenaJournal, Committed, TailMark
from .prefix import FamId, PrefixIndex, family_of
from .slab import ArenaAllocator

__all__ = ["Entry", "FamId", "L1Cache", "State"]


def tenant_of(key: ObjectKey) -> str:
    """The tenant whose namespace a key's salt is in (`~name~salt`; plain salts: the default tenant)."""
    salt = key.salt
    if salt[:1] == "~":
        end = salt.find("~", 1)
        if end > 0:
            return salt[1:end]
    return "default"


class State(enum.Enum):
    WRITING = "writing"
    READY = "ready"


@dataclass(slots=True)
class Entry:
    offset: int
    size: int
    state: State = State.WRITING
    leases: int = 0
    pinned: bool = False
    checksum: int = 0  # kvsum64 of the bytes, given by the writer's commit; readers verify against it
    checked: bool = False  # a reader's corrupt report was checked and the bytes matched (corruption.py)
    tail: TailMark | None = None  # a tail (a partial last chunk): journaled, so a restart finds it again


class L1Cache:
    def __init__(self, arena: Arena, policy: EvictionPolicy[ObjectKey]) -> None:
        self.arena = arena
        self.policy = policy
        self.alloc = ArenaAllocator(arena.capacity, base=HEADER_BYTES)  # the header page is not ours
        self.entries: dict[ObjectKey, Entry] = {}
        self.prefix = PrefixIndex()  # chunks (families of objects) and which chunk extends which
        self._at: dict[int, ObjectKey] = {}  # offset -> key, to find an eviction victim's neighbours
        self.evictions = 0
        # maintained incrementally so describe() and /metrics never scan the index
        self.n_writing = 0
        self.n_leased = 0
        self.n_pinned = 0
        # (until, offset, size, tenant), in `until` order; the bytes stay charged to the tenant until freed
        self._quarantine: deque[tuple[float, int, int, str]] = deque()
        self.quarantined_bytes = 0
        self.on_evict: list[Callable[[ObjectKey], None]] = []
        # each object eviction takes, while its bytes are still in the arena: (key, entry, parent chunk hash)
        self.before_evict: list[Callable[[ObjectKey, Entry, bytes | None], None]] = []
        self.on_clear: list[Callable[[ObjectKey], None]] = []  # each object `clear` removes
        self.tenant_bytes: dict[str, int] = {}  # L1 bytes held per tenant (reserved or ready)
        self.journal: ArenaJournal | None = None  # records ready objects for a warm restart (journal.py)
        # each adopted tail that passed its check: (key, its mark, the hash of the chunk it follows or None)
        self.on_tail_adopted: list[Callable[[ObjectKey, TailMark, bytes | None], None]] = []

    # -- queries -------------------------------------------------------------------------------
    def ready(self, key: ObjectKey) -> Entry | None:
        e = self.entries.get(key)
        return e if e is not None and e.state is State.READY else None

    def evictable(self, key: ObjectKey) -> bool:
        """Ready, unleased and unpinned, like every other object of its chunk; and no resident chunk
        extends it (prefixes shrink from the tail). See prefix.py."""
        e = self.entries.get(key)
        if e is None or e.state is not State.READY or e.leases or e.pinned:
            return False
        if self.prefix.extended(key):
            return False
        for k in self.prefix.siblings(key):
            s = self.entries.get(k)
            if s is None or s.state is not State.READY or s.leases or s.pinned:
                return False
        return True

    @property
    def used_bytes(self) -> int:
        return self.alloc.used_bytes

    def count(self, state: State | None = None) -> int:
        if state is None:
            return len(self.entries)
        return self.n_writing if state is State.WRITING else len(self.entries) - self.n_writing

    def leased_objects(self) -> int:
        return self.n_leased

    def pinned_objects(self) -> int:
        return self.n_pinned

    # -- writes --------------------------------------------------------------------------------
    def reserve(self, key: ObjectKey, size: int, parent: bytes | None = None) -> Entry | None:
        """Allocate a WRITING slot for a key that is not present; evicts as needed.

        `parent` is the hash of the chunk this one extends: linked before anything is evicted, so
        the prefix being extended is never evicted to make room for its own continuation. The policy
        learns the same link (its object of the same rank and group) once the slot is held.
        """
        assert key not in self.entries
        if size > self.alloc.capacity:
            return None
        self.prefix.add(key, parent)
        offset = self.alloc.alloc(size)
        while offset is None:
            victim = self.policy.pop_victim(self.evictable)
            if victim is None:
                self.prefix.remove(key)
                return None
            where = self.entries[victim].offset
            self._evict_chunk(victim)
            offset = self.alloc.alloc(size)
            if offset is None:  # sizes mix: free a contiguous window around the victim's hole
                offset = self._evict_window(where, size)
        entry = Entry(offset, size)
        self.entries[key] = entry
        self._at[offset] = key
        self.n_writing += 1
        tenant = tenant_of(key)
        self.tenant_bytes[tenant] = self.tenant_bytes.get(tenant, 0) + size
        self.policy.on_reserve(key, None if parent is None else key._replace(chunk_hash=parent))
        return entry

    def evict_one(self, only: Callable[[ObjectKey], bool]) -> bool:
        """Evict one evictable object that `only` accepts (a tenant over its quota evicts its own first)."""
        victim = self.policy.pop_victim(lambda k: self.evictable(k) and only(k))
        if victim is None:
            return False
        self._evict_chunk(victim)
        return True

    def _evict_chunk(self, victim: ObjectKey) -> None:
        """Evict the victim (already forgotten by the policy) and the other objects of its chunk."""
        for k in list(self.prefix.siblings(victim)):
            if k != victim:
                self.policy.on_remove(k)
            if self.before_evict:
                parent = self.prefix.parent.get(family_of(k))
                for early in self.before_evict:
                    early(k, self.entries[k], None if parent is None else parent[3])
            self._drop(k)
            self.evictions += 1
            for hook in self.on_evict:
                hook(k)

    def _evict_window(self, where: int, size: int) -> int | None:
        """Evict the cheapest run of evictable neighbours that, with the hole at `where`, spans `size`.

        The run starts or ends at the hole and grows one neighbour at a time, so it overshoots the
        need by less than one object. None when leased, pinned, writing or quarantined neighbours
        (or the arena's ends) leave no such run; the caller then takes the policy's next victim.
        """
        need = self.alloc.slot_size(size)
        start, end = self.alloc.hole_at(where)

        def side(segments: Iterator[tuple[int, int, bool]]) -> list[tuple[int, int, bool]]:
            out, got = [], end - start
            for seg in segments:
                if got >= need or (seg[2] and not self._neighbour_evictable(seg[0])):
                    break
                out.append(seg)
                got += seg[1]
            return out

        segs = side(self.alloc.left_of(start))[::-1] + [(start, end - start, False)]
        segs += side(self.alloc.right_of(end))
        best: tuple[int, int, int] | None = None  # (bytes evicted, first, last)
        for i in range(len(segs)):
            span = cost = 0
            for j in range(i, len(segs)):
                span += segs[j][1]
                if segs[j][2]:
                    cost += sum(self.entries[k].size for k in self.prefix.siblings(self._at[segs[j][0]]))
                if span >= need:
                    if best is None or cost < best[0]:
                        best = (cost, i, j)
                    break
        if best is None:
            return None
        for seg_start, _, used in segs[best[1] : best[2] + 1]:
            k = self._at.get(seg_start)
            if used and k is not None:  # None: already gone as a sibling of an earlier neighbour
                self.policy.on_remove(k)
                self._evict_chunk(k)
        return self.alloc.alloc(size)

    def _neighbour_evictable(self, offset: int) -> bool:
        key = self._at.get(offset)  # None: a quarantined slot
        return key is not None and self.evictable(key)

    def link_chain(self, model: str, world: int, salt: str, hashes: list[bytes]) -> None:
        """Link each resident chunk of a prefix to the chunk before it (after an L2 prefetch); the
        policy learns the same links, object by object."""
        for i in range(1, len(hashes)):
            fam = (model, world, salt, hashes[i])
            self.prefix.link(fam, (model, world, salt, hashes[i - 1]))
            for key in self.prefix.members.get(fam, ()):
                self.policy.on_link(key, key._replace(chunk_hash=hashes[i - 1]))

    def finish_write(self, key: ObjectKey) -> None:
        entry = self.entries[key]
        assert entry.state is State.WRITING
        entry.state = State.READY
        self.n_writing -= 1
        self.policy.on_insert(key)
        if self.journal is not None:
            self.journal.commit(self._committed(key, entry))
            if self.journal.due():
                self.journal.compact(self._committed(k, e) for k, e in self.entries.items() if e.state is State.READY)

    def _committed(self, key: ObjectKey, entry: Entry) -> Committed:
        parent = self.prefix.parent.get(family_of(key))
        hash_before = None if parent is None else parent[3]
        return Committed(key, entry.offset, entry.size, entry.checksum, hash_before, entry.tail)

    # -- warm restart --------------------------------------------------------------------------
    def adopt(self, found: list[Committed], keep: Callable[[ObjectKey], bool]) -> list[ObjectKey]:
        """Take back the slots of a previous server's ready objects, as WRITING (invisible) entries.

        They are charged to their tenants and hold their slots, but no reader sees them until
        `finish_adopt` says their bytes passed their checksum. A record whose slot overlaps another,
        lies outside the arena, or whose key `keep` refuses (a tenant that no longer exists) is dropped.
        """
        adopted: list[ObjectKey] = []
        for c in sorted(found, key=lambda c: c.offset):
            if c.size <= 0 or c.key in self.entries or not keep(c.key) or not self.alloc.take(c.offset, c.size):
                continue
            self.prefix.add(c.key, c.parent)
            self.entries[c.key] = Entry(c.offset, c.size, checksum=c.checksum, tail=c.tail)
            self._at[c.offset] = c.key
            self.n_writing += 1
            tenant = tenant_of(c.key)
            self.tenant_bytes[tenant] = self.tenant_bytes.get(tenant, 0) + c.size
            self.policy.on_reserve(c.key, None if c.parent is None else c.key._replace(chunk_hash=c.parent))
            adopted.append(c.key)
        return adopted

    def finish_adopt(self, key: ObjectKey, verified: bool) -> None:
        """An adopted object's bytes were checked: ready (and journaled again) if they passed, else freed."""
        entry = self.entries.get(key)
        if entry is None or entry.state is not State.WRITING:
            return
        if verified:
            self.finish_write(key)
            if entry.tail is not None:
                parent = self.prefix.parent.get(family_of(key))
                for hook in self.on_tail_adopted:
                    hook(key, entry.tail, None if parent is None else parent[3])
        else:
            self.abort_write(key)

    def abort_write(self, key: ObjectKey) -> None:
        entry = self.entries.get(key)
        if entry is not None and entry.state is State.WRITING:
            self.policy.on_remove(key)  # it saw the reservation (on_reserve), never the insert
            self._drop(key)

    def quarantine_write(self, key: ObjectKey, until: float) -> None:
        """Drop a WRITING object from the index but keep its slot allocated until `until`.

        `until` must not decrease from one call to the next (callers pass now + a fixed TTL).
        """
        entry = self.entries.get(key)
        if entry is None or entry.state is not State.WRITING:
            return
        self.policy.on_remove(key)
        del self.entries[key]
        del self._at[entry.offset]
        self.prefix.remove(key)
        self.n_writing -= 1
        # still charged: a tenant looping store-and-abort must hit its own quota, not fill the arena
        self._quarantine.append((until, entry.offset, entry.size, tenant_of(key)))
        self.quarantined_bytes += entry.size

    def drain_quarantine(self, now: float) -> int:
        """Free the quarantined slots whose time is up; returns how many."""
        freed = 0
        while self._quarantine and self._quarantine[0][0] <= now:
            _, offset, size, tenant = self._quarantine.popleft()
            self.alloc.free(offset)
            self.quarantined_bytes -= size
            self._uncharge_tenant(tenant, size)
            freed += 1
        return freed

    @property
    def quarantined_slots(self) -> int:
        return len(self._quarantine)

    # -- leases and pins -----------------------------------------------------------------------
    def lease(self, key: ObjectKey) -> None:
        entry = self.entries[key]
        entry.leases += 1
        self.n_leased += entry.leases == 1

    def unlease(self, key: ObjectKey) -> None:
        entry = self.entries.get(key)
        if entry is not None and entry.leases > 0:
            entry.leases -= 1
            self.n_leased -= entry.leases == 0

    def touch(self, key: ObjectKey) -> None:
        self.policy.on_access(key)

    def touch_many(self, keys: Sequence[ObjectKey]) -> None:
        """Touch each key in order: one call per lookup, not per object (the policy's fast loop)."""
        self.policy.on_access_many(keys)

    def set_pinned(self, key: ObjectKey, pinned: bool) -> bool:
        entry = self.ready(key)
        if entry is None:
            return False
        self.n_pinned += int(pinned) - int(entry.pinned)
        entry.pinned = pinned
        return True

    # -- removal -------------------------------------------------------------------------------
    def clear(self) -> int:
        """Remove every ready, unleased object (pinned ones too); returns how many."""
        doomed = [k for k, e in self.entries.items() if e.state is State.READY and e.leases == 0]
        for key in doomed:
            self.policy.on_remove(key)
            self._drop(key)
            for hook in self.on_clear:
                hook(key)
        return len(doomed)

    def remove(self, key: ObjectKey) -> None:
        """Drop one ready, unleased object at once (a rolled-back reservation's, see reservations.py)."""
        entry = self.entries.get(key)
        if entry is None or entry.state is not State.READY or entry.leases:
            return
        self.policy.on_remove(key)
        self._drop(key)

    def _drop(self, key: ObjectKey) -> None:
        entry = self.entries.pop(key)
        if self.journal is not None and entry.state is State.READY:
            self.journal.free(entry.offset)  # recorded before the slot can be handed to a writer
        del self._at[entry.offset]
        self.prefix.remove(key)
        self.n_writing -= entry.state is State.WRITING
        self.n_leased -= entry.leases > 0
        self.n_pinned -= entry.pinned
        self.alloc.free(entry.offset)
        self._uncharge(key, entry.size)

    def _uncharge(self, key: ObjectKey, size: int) -> None:
        self._uncharge_tenant(tenant_of(key), size)

    def _uncharge_tenant(self, tenant: str, size: int) -> None:
        left = self.tenant_bytes.get(tenant, 0) - size
        if left > 0:
            self.tenant_bytes[tenant] = left
        else:
            self.tenant_bytes.pop(tenant, None)
