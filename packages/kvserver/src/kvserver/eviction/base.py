"""The small interface every eviction policy implements.

A policy only orders keys. The object index decides what may be evicted (never a leased, pinned or
writing object) and passes that test in as `evictable`; the policy skips keys that fail it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable

Key = Hashable
Evictable = Callable[[Key], bool]


class EvictionPolicy(ABC):
    name: str = "base"

    @abstractmethod
    def on_insert(self, key: Key) -> None:
        """A key became readable."""

    @abstractmethod
    def on_access(self, key: Key) -> None:
        """A key was hit by a lookup."""

    @abstractmethod
    def on_remove(self, key: Key) -> None:
        """A key left the cache for a reason other than eviction (clear, delete)."""

    @abstractmethod
    def pop_victim(self, evictable: Evictable) -> Key | None:
        """Choose, forget and return the next key to evict, or None when nothing is evictable."""

    @abstractmethod
    def __len__(self) -> int: ...
