"""S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO and a ghost FIFO.

One-hit wonders leave through the small queue quickly; objects hit again are promoted to main,
where they get a second chance per hit (frequency capped at 3).
"""

from __future__ import annotations

from collections import OrderedDict

from .base import EvictionPolicy, Evictable, Key

SMALL_FRACTION = 0.1
MAX_FREQ = 3


class S3FIFOPolicy(EvictionPolicy):
    name = "s3fifo"

    def __init__(self) -> None:
        self.small: OrderedDict[Key, None] = OrderedDict()
        self.main: OrderedDict[Key, None] = OrderedDict()
        self.ghost: OrderedDict[Key, None] = OrderedDict()
        self.freq: dict[Key, int] = {}

    def on_insert(self, key: Key) -> None:
        self.freq[key] = 0
        if key in self.ghost:
            del self.ghost[key]
            self.main[key] = None
        else:
            self.small[key] = None

    def on_access(self, key: Key) -> None:
        if key in self.freq:
            self.freq[key] = min(MAX_FREQ, self.freq[key] + 1)

    def on_remove(self, key: Key) -> None:
        self.small.pop(key, None)
        self.main.pop(key, None)
        self.freq.pop(key, None)

    def pop_victim(self, evictable: Evictable) -> Key | None:
        # Each key is looked at a bounded number of times, so a cache full of leased objects ends.
        budget = 2 * (MAX_FREQ + 1) * (len(self) + 1)
        while budget > 0 and len(self):
            budget -= 1
            if self.small and (len(self.small) >= SMALL_FRACTION * len(self) or not self.main):
                key, _ = self.small.popitem(last=False)
                if self.freq[key] > 0:
                    self.freq[key] = 0
                    self.main[key] = None
                elif evictable(key):
                    del self.freq[key]
                    self.ghost[key] = None
                    while len(self.ghost) > max(1, len(self)):
                        self.ghost.popitem(last=False)
                    return key
                else:
                    self.small[key] = None
            else:
                key, _ = self.main.popitem(last=False)
                if self.freq[key] > 0:
                    self.freq[key] -= 1
                    self.main[key] = None
                elif evictable(key):
                    del self.freq[key]
                    return key
                else:
                    self.main[key] = None
        return None

    def __len__(self) -> int:
        return len(self.small) + len(self.main)
