"""Least recently used."""

from __future__ import annotations

from collections import OrderedDict

from .base import EvictionPolicy, Evictable, K


class LRUPolicy(EvictionPolicy[K]):
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()

    def on_insert(self, key: K) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: K) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: K) -> None:
        self._order.pop(key, None)

    def pop_victim(self, evictable: Evictable[K]) -> K | None:
        for key in self._order:
            if evictable(key):
                del self._order[key]
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)
