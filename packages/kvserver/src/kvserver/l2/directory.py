"""What this server's L2 holds, bounded, with eviction by a real policy class and in prefix order.

Why: L1 and L2 should behave as one cache. Knowing what L2 holds lets an object L1 evicts be
dropped for free when L2 already has it (no write), and bounding L2 here rather than in each store
lets L2's eviction use what L1 learnt: the policy is one of L1's (lhd ranks by prefix history) and
hits in either tier count. Prefix position matters: a chunk is useless without the chunks before
it, so only chunks no held chunk extends are evicted (a prefix shrinks from its tail), and a chunk
whose admission would have to evict its own prefix is refused instead.

The tiers stay nearly exclusive: a key loaded into L1 is "promoted": L2 keeps its copy, but the
policy forgets it and it is the first to go when L2 needs room (L1 holds it meanwhile). If L1 evicts
it while L2 still has the copy, it is "settled" back into the policy as if just written, at no cost.
Without that, a key read from L2 would occupy both tiers and the two together would hold less.

Keys are whatever the caller uses (ObjectKey in the server, ints in the trace simulator); each key
is one unit of `size` bytes given at admission.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

from ..l1.eviction import EvictionPolicy

K = TypeVar("K", bound=Hashable)


class L2Directory(Generic[K]):
    def __init__(self, policy: EvictionPolicy[K], capacity_bytes: int | None = None) -> None:
        self.policy = policy
        self.capacity = capacity_bytes
        self.size: dict[K, int] = {}
        self.parent: dict[K, K] = {}  # held key -> the key it extends (held or not)
        self.kids: dict[K, set[K]] = {}  # key (held or not) -> held keys extending it
        self.promoted: OrderedDict[K, None] = OrderedDict()  # held keys L1 also holds, out of the policy
        self.bytes = 0
        self.admitted = 0
        self.refused = 0  # did not fit without evicting its own prefix
        self.evicted = 0

    def __contains__(self, key: K) -> bool:
        return key in self.size

    def __len__(self) -> int:
        return len(self.size)

    def admit(self, key: K, size: int, parent: K | None = None) -> tuple[bool, list[K]]:
        """Record `key` as written to L2: (whether it was admitted, keys to delete from the tier).

        Room is made by the policy's victims among keys nothing held extends, never the key's own
        held prefix; when none is left the key is refused (victims already chosen still go).
        """
        if key in self.size:
            return True, []
        victims: list[K] = []
        protect = self._prefix(parent)
        fits = self.capacity is None or size <= self.capacity
        while fits and self.capacity is not None and self.bytes + size > self.capacity:
            victim = self._promoted_victim(protect)
            if victim is None:
                victim = self.policy.pop_victim(lambda k: not self.kids.get(k) and k not in protect)
            if victim is None:
                fits = False
                break
            self._drop(victim)
            victims.append(victim)
        self.evicted += len(victims)
        if not fits:
            self.refused += 1
            return False, victims
        self.size[key] = size
        self.bytes += size
        if parent is not None and parent != key:
            self.parent[key] = parent
            self.kids.setdefault(parent, set()).add(key)
        self.policy.on_reserve(key, parent)
        self.policy.on_insert(key)
        self.admitted += 1
        return True, victims

    def hit(self, keys: Sequence[K]) -> None:
        """Keys a lookup used from either tier, tail first (as L1's lookup touches them)."""
        held = [k for k in keys if k in self.size and k not in self.promoted]
        if held:
            self.policy.on_access_many(held)

    def promote(self, keys: Sequence[K]) -> None:
        """Held keys a lookup loaded into L1: first to go from L2 while L1 holds them."""
        for key in keys:
            if key in self.size and key not in self.promoted:
                self.policy.on_remove(key)
                self.promoted[key] = None

    def settle(self, key: K) -> bool:
        """L1 evicts `key`: True (nothing to write) if L2 still holds it, back in the policy."""
        if key not in self.size:
            return False
        if self.promoted.pop(key, 0) is None:
            self.policy.on_reserve(key, self.parent.get(key))
            self.policy.on_insert(key)
        return True

    def discard(self, key: K) -> None:
        """The tier lost `key` (found absent or corrupt, or deleted by someone else)."""
        if key in self.size:
            if self.promoted.pop(key, 0) is not None:
                self.policy.on_remove(key)
            self._drop(key)

    def _promoted_victim(self, protect: set[K]) -> K | None:
        """The oldest promoted key outside `protect` (L1 has it: its prefix there stays whole)."""
        for key in self.promoted:
            if key not in protect:
                del self.promoted[key]
                return key
        return None

    def _prefix(self, key: K | None) -> set[K]:
        """`key` and the held keys before it, as far as the chain is held."""
        out: set[K] = set()
        while key is not None and key in self.size and key not in out:
            out.add(key)
            key = self.parent.get(key)
        return out

    def _drop(self, key: K) -> None:
        self.bytes -= self.size.pop(key)
        parent = self.parent.pop(key, None)
        if parent is not None:
            kids = self.kids[parent]
            kids.discard(key)
            if not kids:
                del self.kids[parent]
