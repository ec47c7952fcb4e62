"""Tails: where the stored lengths of partial last chunks are remembered, so a lookup can find one.

A tail is the KV of the tokens past a prompt's (or a conversation's) last full chunk, stored as one
more object under `kvprotocol.tail_hash` of those tokens (Store.tail). A lookup sends the whole next
prompt, whose tokens after the hit's full chunks run on past the stored tail (the next user turn),
so the server cannot hash "the" tail: it asks this index which lengths were stored after the chunk
the hit stops at, hashes those prefixes of the remaining tokens and probes L1 for them.

Why an index rather than hashing every length: a chunk of 256 tokens has 255 candidate tails. The
index is a hint, bounded and forgetful: an entry whose object was evicted costs one probe that
misses, a forgotten one a tail not found (recomputed). Keyed by the tenant-scoped salt, so a
tenant's lengths never answer another's lookup (and the probe needs the object under its own salt),
and shared fairly between tenants, so one cannot push out the others' lengths.
May import: nothing of the server's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvprotocol import KeySpace

MAX_PARENTS = 1 << 16  # chunks with a tail after them, remembered (least recently stored forgotten first)
MAX_LENGTHS = 4  # distinct tail lengths remembered per chunk (the most recent)

Parent = tuple[KeySpace, str, bytes]  # (key space, tenant-scoped salt, hash of the chunk before: ZERO_HASH at 0)


def _one_owner(salt: str) -> str:
    return ""


class TailIndex:
    """Tail lengths stored after each chunk, most recent first.

    Bounded as a whole and shared fairly: each owner (the tenant, `owner` of a parent's salt) has its
    own recency order, and a full index forgets the adding owner's oldest entry while that owner
    holds at least an equal share, else the oldest of the owner holding the most. So a tenant that
    stores tails without end only ever pushes out its own lengths once others hold their share."""

    def __init__(self, max_parents: int = MAX_PARENTS, owner: Callable[[str], str] = _one_owner) -> None:
        self.max_parents = max_parents
        self._owner = owner
        self._by_owner: dict[str, OrderedDict[Parent, tuple[int, ...]]] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def held(self, owner: str) -> int:
        """How many chunks' lengths `owner` has in the index."""
        return len(self._by_owner.get(owner, ()))

    def add(self, parent: Parent, length: int) -> None:
        who = self._owner(parent[1])
        mine = self._by_owner.setdefault(who, OrderedDict())
        old = mine.pop(parent, None)
        if old is None:
            self._size += 1
        mine[parent] = (length, *(n for n in old or () if n != length))[:MAX_LENGTHS]
        while self._size > self.max_parents:
            self._forget_one(who)

    def lengths(self, parent: Parent) -> tuple[int, ...]:
        mine = self._by_owner.get(self._owner(parent[1]))
        return () if mine is None else mine.get(parent, ())

    def _forget_one(self, adding: str) -> None:
        share = self.max_parents // len(self._by_owner)
        victim = adding
        if len(self._by_owner[adding]) <= share:  # below its share: the largest holder gives way
            victim = max(self._by_owner, key=lambda o: len(self._by_owner[o]))
        entries = self._by_owner[victim]
        entries.popitem(last=False)
        self._size -= 1
        if not entries:
            del self._by_owner[victim]


__all__ = ["MAX_LENGTHS", "MAX_PARENTS", "TailIndex"]
