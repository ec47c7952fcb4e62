"""Eviction candidates ranked by hit density, for lhd.py.

Candidates are grouped by (class, coarse time of last access): every key of a group has the same
density, so ranking groups is enough, and within a group keys stay in access order. The ranking is
recomputed when coarse time moves on (every group ages by one bin) or the estimate changes; a group
created in between is inserted in order. The victim is the first evictable key of the
lowest-density group, ties going to the older group: with one class and a density that falls with
age this is LRU.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic

from .base import Evictable, K
from .density import HitDensity

Gid = tuple[int, int]  # (class, coarse time of last access)
Rank = tuple[float, int, int]  # (density, coarse time, class): sorts lowest density, then oldest, first


class DensityRanking(Generic[K]):
    def __init__(self, est: HitDensity) -> None:
        self.est = est
        self._gid: dict[K, Gid] = {}
        self._groups: dict[Gid, OrderedDict[K, None]] = {}
        self._rank: list[Rank] = []  # may hold stale entries: an entry counts only while _entry has it
        self._entry: dict[Gid, Rank] = {}
        self._tick = -1  # coarse time _rank was computed at; -1: stale

    def __contains__(self, key: K) -> bool:
        return key in self._gid

    def __len__(self) -> int:
        return len(self._gid)

    @property
    def groups(self) -> int:
        return len(self._groups)

    def add(self, key: K, cls: int, last: int) -> None:
        """Make `key` a candidate of class `cls`, last accessed at policy time `last`."""
        gid = (cls, last >> self.est.shift)
        group = self._groups.get(gid)
        if group is None:
            group = self._groups[gid] = OrderedDict()
            if self._tick >= 0:
                entry = self._rank_of(gid, self._tick)
                self._entry[gid] = entry
                bisect.insort(self._rank, entry)
        group[key] = None
        self._gid[key] = gid

    def discard(self, key: K) -> None:
        gid = self._gid.pop(key, None)
        if gid is None:
            return
        group = self._groups[gid]
        del group[key]
        if not group:
            del self._groups[gid]
            self._entry.pop(gid, None)

    def victim(self, evictable: Evictable[K], now: int) -> K | None:
        """The first evictable candidate in density order (not removed), or None."""
        tick = now >> self.est.shift
        if tick != self._tick:
            self._rerank(tick)
        stale = 0
        found: K | None = None
        for i, entry in enumerate(self._rank):
            gid = (entry[2], entry[1])
            if self._entry.get(gid) is not entry:  # its group emptied, or it was re-ranked
                if stale == i:
                    stale += 1  # leading stale entries are trimmed below
                continue
            found = next((k for k in self._groups[gid] if evictable(k)), None)
            if found is not None:
                break
        if stale:
            del self._rank[:stale]
        return found

    def invalidate(self) -> None:
        """The densities changed: rank again before the next victim."""
        self._tick = -1

    def regroup(self, last_of: Callable[[K], tuple[int, int]]) -> None:
        """Group every candidate again after the coarse time unit changed; `last_of(key)` gives its
        (class, last access)."""
        old = sorted(self._groups.items(), key=lambda item: item[0][1])  # oldest first, order kept
        self._gid, self._groups, self._entry, self._rank, self._tick = {}, {}, {}, [], -1
        for _, group in old:
            for key in group:
                self.add(key, *last_of(key))

    def __iter__(self) -> Iterator[K]:
        return iter(self._gid)

    def _rank_of(self, gid: Gid, tick: int) -> Rank:
        cls, start = gid
        return (self.est.density[cls][self.est.bin(max(0, tick - start))], start, cls)

    def _rerank(self, tick: int) -> None:
        density, oldest = self.est.density, self.est.ages - 1
        self._entry = {
            (cls, start): (density[cls][min(tick - start, oldest)], start, cls) for cls, start in self._groups
        }
        self._rank = sorted(self._entry.values())
        self._tick = tick
