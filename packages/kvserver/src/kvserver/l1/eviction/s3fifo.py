"""S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO and a ghost FIFO.

One-hit wonders leave through the small queue quickly; objects hit again are promoted to main,
where they get a second chance per hit (frequency capped at 3).
"""

from __future__ import annotations

from collections import OrderedDict

from .base import EvictionPolicy, Evictable, K

SMALL_FRACTION = 0.1
MAX_FREQ = 3


class S3FIFOPolicy(EvictionPolicy[K]):
    name = "s3fifo"

    def __init__(self) -> None:
        self.small: OrderedDict[K, None] = OrderedDict()
        self.main: OrderedDict[K, None] = OrderedDict()
        self.ghost: OrderedDict[K, None] = OrderedDict()
        self.freq: dict[K, int] = {}
        self._capacity = 0  # ghost size bound: the most objects ever resident

    def on_insert(self, key: K) -> None:
        self.freq[key] = 0
        if key in self.ghost:
            del self.ghost[key]
            self.main[key] = None
        else:
            self.small[key] = None
        self._capacity = max(self._capacity, len(self))

    def on_access(self, key: K) -> None:
        if key in self.freq:
            self.freq[key] = min(MAX_FREQ, self.freq[key] + 1)

    def on_remove(self, key: K) -> None:
        self.small.pop(key, None)
        self.main.pop(key, None)
        self.freq.pop(key, None)

    def pop_victim(self, evictable: Evictable[K]) -> K | None:
        # Protected keys are rotated to the tail; once a queue has been rotated through without a
        # victim it is skipped for the rest of this call, so a cache full of leased objects ends.
        small_stuck = main_stuck = 0
        budget = 2 * (MAX_FREQ + 1) * (len(self) + 1)
        while budget > 0 and len(self):
            budget -= 1
            small_ok = self.small and small_stuck < len(self.small)
            main_ok = self.main and main_stuck < len(self.main)
            if small_ok and (len(self.small) >= SMALL_FRACTION * len(self) or not main_ok):
                key, _ = self.small.popitem(last=False)
                if self.freq[key] > 0:
                    self.freq[key] = 0
                    self.main[key] = None
                elif evictable(key):
                    del self.freq[key]
                    self.ghost[key] = None
                    while len(self.ghost) > max(1, self._capacity):
                        self.ghost.popitem(last=False)
                    return key
                else:
                    self.small[key] = None
                    small_stuck += 1
            elif main_ok:
                key, _ = self.main.popitem(last=False)
                if self.freq[key] > 0:
                    self.freq[key] -= 1
                    self.main[key] = None
                elif evictable(key):
                    del self.freq[key]
                    return key
                else:
                    self.main[key] = None
                    main_stuck += 1
            else:
                break
        return None

    def __len__(self) -> int:
        return len(self.small) + len(self.main)
