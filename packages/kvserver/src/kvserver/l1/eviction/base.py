"""The small interface every eviction policy implements.

A policy only orders keys. The object index decides what may be evicted (never a leased, pinned or
writing object) and passes that test in as `evictable`; the policy skips keys that fail it.
Policies are generic over the key type: L1 keys them by kvprotocol.ObjectKey, unit tests and the
trace simulator by whatever hashable they like, and each gets its own key type back from `pop_victim`.

`on_reserve` and `on_link` are optional (no-ops here): they tell a policy which key a key extends,
for policies that learn from a prefix's history (lhd.py). A reserved key that
never becomes readable (aborted, quarantined) gets `on_remove`, which every policy already takes
for keys it does not hold.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
Evictable = Callable[[K], bool]  # generic alias: Evictable[K]


class EvictionPolicy(ABC, Generic[K]):
    name: str = "base"

    def on_reserve(self, key: K, parent: K | None) -> None:
        """A slot was reserved for `key` (not readable yet); `parent` is the key of the chunk it extends."""

    def on_link(self, key: K, parent: K) -> None:
        """`key`, reserved or ready, extends `parent` (learnt after the fact: an L2 prefetch)."""

    @abstractmethod
    def on_insert(self, key: K) -> None:
        """A key became readable."""

    @abstractmethod
    def on_access(self, key: K) -> None:
        """A key was hit by a lookup."""

    def on_access_many(self, keys: Sequence[K]) -> None:
        """`on_access` of each key in order (one lookup's hits, tail first). A policy may override it
        with a faster loop; the result must be exactly that of the single calls."""
        for key in keys:
            self.on_access(key)

    @abstractmethod
    def on_remove(self, key: K) -> None:
        """A key left the cache for a reason other than eviction (clear, delete)."""

    @abstractmethod
    def pop_victim(self, evictable: Evictable[K]) -> K | None:
        """Choose, forget and return the next key to evict, or None when nothing is evictable."""

    @abstractmethod
    def __len__(self) -> int: ...
