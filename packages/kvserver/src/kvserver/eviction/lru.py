"""Least recently used."""

from __future__ import annotations

from collections import OrderedDict

from .base import EvictionPolicy, Evictable, Key


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def on_insert(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def pop_victim(self, evictable: Evictable) -> Key | None:
        for key in self._order:
            if evictable(key):
                del self._order[key]
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)
