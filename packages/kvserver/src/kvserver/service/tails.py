"""Tails: where the stored lengths of partial last chunks are remembered, so a lookup can find one.

A tail is the KV of the tokens past a prompt's (or a conversation's) last full chunk, stored as one
more object under `kvprotocol.tail_hash` of those tokens (Store.tail). A lookup sends the whole next
prompt, whose tokens after the hit's full chunks run on past the stored tail (the next user turn),
so the server cannot hash "the" tail: it asks this index which lengths were stored after the chunk
the hit stops at, hashes those prefixes of the remaining tokens and probes L1 for them.

Why an index rather than hashing every length: a chunk of 256 tokens has 255 candidate tails. The
index is a hint, bounded and forgetful: an entry whose object was evicted costs one probe that
misses, a forgotten one a tail not found (recomputed). Keyed by the tenant-scoped salt, so a
tenant's lengths never answer another's lookup (and the probe needs the object under its own salt).
May import: nothing of the server's.
"""

from __future__ import annotations

from collections import OrderedDict

from kvprotocol import KeySpace

MAX_PARENTS = 1 << 16  # chunks with a tail after them, remembered (least recently stored forgotten first)
MAX_LENGTHS = 4  # distinct tail lengths remembered per chunk (the most recent)

Parent = tuple[KeySpace, str, bytes]  # (key space, tenant-scoped salt, hash of the chunk before: ZERO_HASH at 0)


class TailIndex:
    """Tail lengths stored after each chunk, most recent first."""

    def __init__(self, max_parents: int = MAX_PARENTS) -> None:
        self.max_parents = max_parents
        self._lengths: OrderedDict[Parent, tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lengths)

    def add(self, parent: Parent, length: int) -> None:
        old = self._lengths.pop(parent, ())
        self._lengths[parent] = (length, *(n for n in old if n != length))[:MAX_LENGTHS]
        while len(self._lengths) > self.max_parents:
            self._lengths.popitem(last=False)

    def lengths(self, parent: Parent) -> tuple[int, ...]:
        return self._lengths.get(parent, ())


__all__ = ["MAX_LENGTHS", "MAX_PARENTS", "TailIndex"]
