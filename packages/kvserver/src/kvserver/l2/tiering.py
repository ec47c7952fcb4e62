"""L1 and L2 as one cache (`--l2-admission evicted` / `evicted-hit`): L2 is written when L1 evicts.

Why: writing every commit makes L2 a copy of L1 plus the rest, so the two tiers hold about as much
as the larger one. Writing on eviction instead keeps them nearly exclusive. What the tier manager
needs for that, glued to L1's and the prefetcher's hooks:
- an object L1 evicts that the directory says L2 holds is dropped for free (no write);
- one L2 lacks is admitted per the demotion rule (demotion.py) and the directory (directory.py):
  its bytes are copied out of the arena before the slot is reused and queued for the write;
- the directory's victims (a bounded L2, evicted by a real policy, tail first) are deleted from
  every tier in the background;
- lookups' hits feed the demotion rule and L2's policy; what a prefetch loads is promoted (the
  directory's first victims while L1 holds it; settled back for free when L1 evicts it).
The directory starts empty: an object a previous server left in L2 is learnt when a prefetch loads
it; until then its eviction from L1 writes it again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from kvprotocol import ObjectKey

from ..l1.cache import Entry, L1Cache
from ..l1.eviction import make_policy
from .demotion import Demotion
from .directory import L2Directory

MODES = {"evicted": "evicted", "evicted-hit": "hit"}  # --l2-admission -> demotion rule


class Tiering:
    def __init__(
        self,
        l1: L1Cache,
        mode: str,
        capacity_bytes: int | None,
        policy: str,
        write: Callable[[ObjectKey, bytes, int], bool],
        delete: Callable[[list[ObjectKey]], None],
    ) -> None:
        """`write(key, bytes, checksum)` queues a write (False: the queue refused it); `delete(keys)`
        starts their deletion from every tier."""
        self.l1, self.mode = l1, mode
        self.directory: L2Directory[ObjectKey] = L2Directory(make_policy(policy), capacity_bytes)
        self.demotion = Demotion(MODES[mode])
        self.write, self.delete = write, delete
        self.free_drops = 0  # objects L1 evicted that L2 already held: nothing written
        self.demoted = 0  # objects L1 evicted whose write was queued
        self.pending: set[ObjectKey] = set()  # queued or being written: a tier may not have them yet
        # files being deleted (evicted from the directory, or damaged); a count: deletes can overlap
        self.being_deleted: Counter[ObjectKey] = Counter()
        l1.before_evict.append(self.evicting)
        l1.on_clear.append(self.cleared)

    def evicting(self, key: ObjectKey, entry: Entry, parent: bytes | None) -> None:
        """L1 evicts `key` (its bytes still in the arena)."""
        try:
            if self.directory.settle(key):
                self.free_drops += 1
            elif self.demotion.admit(key):
                ok, victims = self.directory.admit(
                    key, entry.size, None if parent is None else key._replace(chunk_hash=parent)
                )
                if victims:
                    self.delete(victims)
                if not ok:
                    return
                if self.write(key, bytes(self.l1.arena.read(entry.offset, entry.size)), entry.checksum):
                    self.demoted += 1
                    self.pending.add(key)
                else:
                    self.directory.discard(key)
        finally:
            self.demotion.forget(key)

    def cleared(self, key: ObjectKey) -> None:
        """`clear` dropped `key` from L1: what L2 holds of it goes back into L2's policy, unwritten."""
        self.directory.settle(key)
        self.demotion.forget(key)

    def hit(self, keys: Sequence[ObjectKey]) -> None:
        """Objects a lookup hit in L1, head first."""
        self.demotion.hit(keys)
        self.directory.hit(list(reversed(keys)))

    def loaded(self, keys: Sequence[ObjectKey]) -> None:
        """Objects a prefetch loaded from L2 into L1: L2 holds them (learnt, if this server did not
        write them and did not evict them while they were read), and they are promoted (the first
        to go from L2 while L1 holds them)."""
        for key in keys:
            entry = self.l1.entries.get(key)
            if key not in self.directory and key not in self.being_deleted and entry is not None:
                _, victims = self.directory.admit(key, entry.size)
                if victims:
                    self.delete(victims)
        self.directory.promote(keys)

    def deleting(self, keys: Sequence[ObjectKey]) -> None:
        """The manager starts deleting `keys`' files (it waits for any prefetch reading them first:
        a load whose own room in L1 demoted others, which made L2 evict the objects it reads, still
        gets them; and they are not taken back into the directory when they land)."""
        self.being_deleted.update(keys)

    def deleted(self, keys: Sequence[ObjectKey]) -> None:
        """The deletion of `keys` is over (done, failed or never started)."""
        for key in keys:
            left = self.being_deleted[key] - 1
            if left > 0:
                self.being_deleted[key] = left
            else:
                self.being_deleted.pop(key, None)

    def missing(self, index: int, keys: Sequence[ObjectKey]) -> None:
        """A tier does not hold `keys` (absent, corrupt, deleted), except those whose write is pending."""
        for key in keys:
            if key not in self.pending:
                self.directory.discard(key)

    def lost(self, keys: Sequence[ObjectKey]) -> None:
        """Writes that failed or were dropped: L2 does not hold these."""
        for key in keys:
            self.directory.discard(key)

    def done(self, keys: Sequence[ObjectKey]) -> None:
        """The writes of `keys` are over (done, failed or skipped)."""
        self.pending.difference_update(keys)

    def describe(self) -> dict[str, object]:
        d = self.directory
        return {
            "mode": self.mode,
            "objects": len(d),
            "bytes": d.bytes,
            "capacity_bytes": d.capacity,
            "policy": d.policy.name,
            "free_drops": self.free_drops,
            "promoted": len(d.promoted),
            "demoted": self.demoted,
            "declined": self.demotion.declined,
            "refused": d.refused,
            "evicted": d.evicted,
        }
