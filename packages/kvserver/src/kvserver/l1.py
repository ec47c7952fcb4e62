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
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

from .arena import HEADER_BYTES, Arena
from .eviction import EvictionPolicy
from .slab import SlabAllocator

IKey = tuple[str, str, int, int, int, str, bytes]  # (model, layout fp, world, rank, group, salt, chunk hash)


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


class L1Cache:
    def __init__(self, arena: Arena, policy: EvictionPolicy) -> None:
        self.arena = arena
        self.policy = policy
        self.alloc = SlabAllocator(arena.capacity, base=HEADER_BYTES)  # the header page is not ours
        self.entries: dict[IKey, Entry] = {}
        self.evictions = 0
        # maintained incrementally so describe() and /metrics never scan the index
        self.n_writing = 0
        self.n_leased = 0
        self.n_pinned = 0
        self._quarantine: deque[tuple[float, int, int]] = deque()  # (until, offset, size), in `until` order
        self.quarantined_bytes = 0
        self.on_evict: list[Callable[[IKey], None]] = []
        self.on_clear: list[Callable[[IKey], None]] = []  # each object `clear` removes

    # -- queries -------------------------------------------------------------------------------
    def ready(self, key: IKey) -> Entry | None:
        e = self.entries.get(key)
        return e if e is not None and e.state is State.READY else None

    def evictable(self, key: Hashable) -> bool:
        e = self.entries.get(key)  # type: ignore[call-overload]
        return e is not None and e.state is State.READY and e.leases == 0 and not e.pinned

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

    def keys(self) -> Iterator[IKey]:
        return iter(self.entries)

    # -- writes --------------------------------------------------------------------------------
    def reserve(self, key: IKey, size: int) -> Entry | None:
        """Allocate a WRITING slot for a key that is not present; evicts as needed."""
        assert key not in self.entries
        if size > self.alloc.capacity:
            return None
        offset = self.alloc.alloc(size)
        while offset is None:
            victim = self.policy.pop_victim(self.evictable)
            if victim is None:
                return None
            self._drop(victim)  # type: ignore[arg-type]
            self.evictions += 1
            for hook in self.on_evict:
                hook(victim)  # type: ignore[arg-type]
            offset = self.alloc.alloc(size)
        entry = Entry(offset, size)
        self.entries[key] = entry
        self.n_writing += 1
        return entry

    def finish_write(self, key: IKey) -> None:
        entry = self.entries[key]
        assert entry.state is State.WRITING
        entry.state = State.READY
        self.n_writing -= 1
        self.policy.on_insert(key)

    def finish_write_and_reserve_read(self, key: IKey) -> Entry:
        """Make a written object readable and lease it in one step, so no eviction slips between."""
        self.finish_write(key)
        entry = self.entries[key]
        self.lease(key)
        return entry

    def abort_write(self, key: IKey) -> None:
        entry = self.entries.get(key)
        if entry is not None and entry.state is State.WRITING:
            self._drop(key)

    def quarantine_write(self, key: IKey, until: float) -> None:
        """Drop a WRITING object from the index but keep its slot allocated until `until`.

        `until` must not decrease from one call to the next (callers pass now + a fixed TTL).
        """
        entry = self.entries.get(key)
        if entry is None or entry.state is not State.WRITING:
            return
        del self.entries[key]
        self.n_writing -= 1
        self._quarantine.append((until, entry.offset, entry.size))
        self.quarantined_bytes += entry.size

    def drain_quarantine(self, now: float) -> int:
        """Free the quarantined slots whose time is up; returns how many."""
        freed = 0
        while self._quarantine and self._quarantine[0][0] <= now:
            _, offset, size = self._quarantine.popleft()
            self.alloc.free(offset)
            self.quarantined_bytes -= size
            freed += 1
        return freed

    @property
    def quarantined_slots(self) -> int:
        return len(self._quarantine)

    # -- leases and pins -----------------------------------------------------------------------
    def lease(self, key: IKey) -> None:
        entry = self.entries[key]
        entry.leases += 1
        self.n_leased += entry.leases == 1

    def unlease(self, key: IKey) -> None:
        entry = self.entries.get(key)
        if entry is not None and entry.leases > 0:
            entry.leases -= 1
            self.n_leased -= entry.leases == 0

    def touch(self, key: IKey) -> None:
        self.policy.on_access(key)

    def set_pinned(self, key: IKey, pinned: bool) -> bool:
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

    def _drop(self, key: IKey) -> None:
        entry = self.entries.pop(key)
        self.n_writing -= entry.state is State.WRITING
        self.n_leased -= entry.leases > 0
        self.n_pinned -= entry.pinned
        self.alloc.free(entry.offset)
