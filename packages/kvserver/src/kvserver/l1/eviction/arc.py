"""Adaptive Replacement Cache (Megiddo & Modha): balances recency (T1) and frequency (T2).

Ghost lists B1/B2 remember recently evicted keys; a hit in a ghost list moves the target size `p`
toward the list that would have kept it. Capacity is counted in objects (all objects of a layout
have one size), tracked as the largest resident count seen.
"""

from __future__ import annotations

from collections import OrderedDict

from .base import EvictionPolicy, Evictable, K


class ARCPolicy(EvictionPolicy[K]):
    name = "arc"

    def __init__(self) -> None:
        self.t1: OrderedDict[K, None] = OrderedDict()
        self.t2: OrderedDict[K, None] = OrderedDict()
        self.b1: OrderedDict[K, None] = OrderedDict()
        self.b2: OrderedDict[K, None] = OrderedDict()
        self.p = 0.0
        self._capacity = 0

    def on_insert(self, key: K) -> None:
        if key in self.b1:
            self.p = min(float(self._capacity), self.p + max(1.0, len(self.b2) / max(1, len(self.b1))))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.p = max(0.0, self.p - max(1.0, len(self.b1) / max(1, len(self.b2))))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        self._capacity = max(self._capacity, len(self))

    def on_access(self, key: K) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def on_remove(self, key: K) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)

    def pop_victim(self, evictable: Evictable[K]) -> K | None:
        first, second = (self.t1, self.t2) if len(self.t1) > self.p or not self.t2 else (self.t2, self.t1)
        for resident in (first, second):
            for key in resident:
                if evictable(key):
                    del resident[key]
                    ghost = self.b1 if resident is self.t1 else self.b2
                    ghost[key] = None
                    while len(ghost) > max(1, self._capacity):
                        ghost.popitem(last=False)
                    return key
        return None

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)
