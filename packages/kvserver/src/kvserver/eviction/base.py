"""The small interface every eviction policy implements.

A policy only orders keys. The object index decides what may be evicted (never a leased, pinned or
writing object) and passes that test in as `evictable`; the policy skips keys that fail it.
Policies are generic over the key type: L1 keys them by kvprotocol.ObjectKey, unit tests and the
trace simulator by whatever hashable they like, and each gets its own key type back from `pop_victim`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
Evictable = Callable[[K], bool]  # generic alias: Evictable[K]


class EvictionPolicy(ABC, Generic[K]):
    name: str = "base"

    @abstractmethod
    def on_insert(self, key: K) -> None:
        """A key became readable."""

    @abstractmethod
    def on_access(self, key: K) -> None:
        """A key was hit by a lookup."""

    @abstractmethod
    def on_remove(self, key: K) -> None:
        """A key left the cache for a reason other than eviction (clear, delete)."""

    @abstractmethod
    def pop_victim(self, evictable: Evictable[K]) -> K | None:
        """Choose, forget and return the next key to evict, or None when nothing is evictable."""

    @abstractmethod
    def __len__(self) -> int: ...
