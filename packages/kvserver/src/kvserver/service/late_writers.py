"""Late writers: an shm writer that stalled (SIGSTOP, swap, a debugger) past its reservation and the
one-TTL quarantine of its slots may still copy into them after they hold another object; found by
the chaos soak (#40), which saw that object fail readers' checksums on every hit until evicted.

Readers never accept those bytes (they verify the writer's checksum), but a hot corrupt object
stays hot. So the server remembers the slots of expired shm reservations (bounded); when their
writer speaks again (its late commit or abort: its copy is over), every object now overlapping
them is checksummed here and dropped if its bytes changed. A leased or still-writing one is checked
at the next sweep instead. Rare by construction, so a linear pass over the index is fine."""

from __future__ import annotations

from collections import OrderedDict


from kvprotocol import ObjectKey

from ..l1.cache import L1Cache, State
from .sessions import StoreTxn

MAX_REMEMBERED = 4096  # expired shm reservations whose slots are remembered (oldest forgotten first)


class LateWriters:
    def __init__(self, l1: L1Cache) -> None:
        self.l1 = l1
        self._spans: OrderedDict[str, tuple[str, list[tuple[int, int]]]] = OrderedDict()
        self._recheck: set[ObjectKey] = set()
        self.dropped = 0  # objects found scribbled on by a late writer, and dropped

    def remember(self, txn: StoreTxn) -> None:
        """An shm reservation ended without a commit: its writer may still be copying."""
        self._spans[txn.id] = (txn.owner, [(s.entry.offset, s.entry.size) for s in txn.slots])
        while len(self._spans) > MAX_REMEMBERED:
            self._spans.popitem(last=False)

    def arrived(self, store_id: str, tenant: str) -> int:
        """The writer of an ended reservation spoke (commit or abort), so its copy is over: check what
        now lies in its slots. Returns how many objects were dropped."""
        got = self._spans.get(store_id)
        if got is None or got[0] != tenant:
            return 0
        del self._spans[store_id]
        spans = got[1]
        hit = [
            k
            for k, e in self.l1.entries.items()
            if any(e.offset < off + size and off < e.offset + e.size for off, size in spans)
        ]
        return sum(self._check(k) for k in hit)

    def sweep(self) -> int:
        """Check again the objects that were leased or still being written at their writer's return."""
        pending, self._recheck = self._recheck, set()
        return sum(self._check(k) for k in pending)

    def _check(self, key: ObjectKey) -> bool:
        entry = self.l1.entries.get(key)
        if entry is None:
            return False
        if entry.state is not State.READY or entry.leases:
            self._recheck.add(key)
            return False
        if self.l1.arena.kvsum(entry.offset, entry.size) == entry.checksum:
            return False
        self.l1.remove(key)
        self.dropped += 1
        return True
