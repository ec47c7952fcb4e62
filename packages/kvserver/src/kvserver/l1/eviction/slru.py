"""Segmented LRU with a ghost list: new objects enter a probationary LRU segment; an object hit
again moves to the protected segment, which is capped at a fraction of the cache (its least recent
objects fall back to probation). Evicted probationary keys are remembered (ghosts) so that one
coming back soon enters protected directly.

Why: in conversation traces a prefix that came back once is much more likely to come back again
(Mooncake conversation trace: 30% of first turns get a second turn, 42% of second turns a third,
over 50% from the fourth on), so first-turn prefixes should leave first, in recency order.
"""

from __future__ import annotations

from collections import OrderedDict

from .base import EvictionPolicy, Evictable, K

PROTECTED_FRACTION = 0.8


class SLRUPolicy(EvictionPolicy[K]):
    name = "slru"

    def __init__(self, protected_fraction: float = PROTECTED_FRACTION) -> None:
        self.probation: OrderedDict[K, None] = OrderedDict()
        self.protected: OrderedDict[K, None] = OrderedDict()
        self.ghost: OrderedDict[K, None] = OrderedDict()
        self.fraction = protected_fraction
        self._capacity = 0

    def on_insert(self, key: K) -> None:
        if key in self.ghost:
            del self.ghost[key]
            self._protect(key)
        else:
            self.probation[key] = None
        self._capacity = max(self._capacity, len(self))

    def on_access(self, key: K) -> None:
        if key in self.protected:
            self.protected.move_to_end(key)
        elif key in self.probation:
            del self.probation[key]
            self._protect(key)

    def _protect(self, key: K) -> None:
        self.protected[key] = None
        limit = max(1, int(self.fraction * max(self._capacity, len(self))))
        while len(self.protected) > limit:
            old, _ = self.protected.popitem(last=False)
            self.probation[old] = None  # demoted: most recent of probation

    def on_remove(self, key: K) -> None:
        self.probation.pop(key, None)
        self.protected.pop(key, None)

    def pop_victim(self, evictable: Evictable[K]) -> K | None:
        for segment in (self.probation, self.protected):
            for key in segment:
                if evictable(key):
                    del segment[key]
                    if segment is self.probation:
                        self.ghost[key] = None
                        while len(self.ghost) > max(1, self._capacity):
                            self.ghost.popitem(last=False)
                    return key
        return None

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)
