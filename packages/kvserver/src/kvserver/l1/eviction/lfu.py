"""Least frequently used; ties broken by least recent use."""

from __future__ import annotations

import heapq
import itertools

from .base import EvictionPolicy, Evictable, K


class LFUPolicy(EvictionPolicy[K]):
    name = "lfu"

    def __init__(self) -> None:
        self._state: dict[K, tuple[int, int]] = {}  # key -> (frequency, last-use sequence)
        self._heap: list[tuple[int, int, K]] = []  # lazy: stale entries are skipped on pop
        self._seq = itertools.count()

    def _touch(self, key: K, freq: int) -> None:
        entry = (freq, next(self._seq))
        self._state[key] = entry
        heapq.heappush(self._heap, (*entry, key))

    def on_insert(self, key: K) -> None:
        self._touch(key, 1)

    def on_access(self, key: K) -> None:
        if key in self._state:
            self._touch(key, self._state[key][0] + 1)

    def on_remove(self, key: K) -> None:
        self._state.pop(key, None)

    def pop_victim(self, evictable: Evictable[K]) -> K | None:
        skipped: list[tuple[int, int, K]] = []
        victim: K | None = None
        while self._heap:
            item = heapq.heappop(self._heap)
            freq, seq, key = item
            if self._state.get(key) != (freq, seq):
                continue  # stale heap entry
            if evictable(key):
                del self._state[key]
                victim = key
                break
            skipped.append(item)
        for item in skipped:
            heapq.heappush(self._heap, item)
        if len(self._heap) > 4 * len(self._state) + 64:
            self._heap = [(*v, k) for k, v in self._state.items()]
            heapq.heapify(self._heap)
        return victim

    def __len__(self) -> int:
        return len(self._state)
