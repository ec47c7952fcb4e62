"""First-fit allocator with coalescing, for the encoder-cache segment.

Why not the slab allocator of L1: KV objects of one layout all have one size, encoder outputs do
not (one per image, sized by its patch grid), and EC traffic is low-frequency (one object per
image, not one per chunk and layer), so a sorted free list is simple and fast enough.
"""

from __future__ import annotations

import bisect

ALIGN = 64  # every object starts on a cache line


def _round(size: int) -> int:
    return (max(size, 1) + ALIGN - 1) // ALIGN * ALIGN


class FirstFitAllocator:
    """Hands out [offset, offset + size) ranges of [base, base + capacity)."""

    def __init__(self, capacity: int, base: int = 0) -> None:
        self.capacity = capacity
        self.base = base
        self._starts: list[int] = [base]  # free ranges, sorted by start, never adjacent
        self._sizes: dict[int, int] = {base: capacity}
        self._used: dict[int, int] = {}  # offset -> rounded size
        self.used_bytes = 0

    def alloc(self, size: int) -> int | None:
        need = _round(size)
        for i, start in enumerate(self._starts):
            free = self._sizes[start]
            if free < need:
                continue
            del self._sizes[start]
            if free == need:
                del self._starts[i]
            else:
                self._starts[i] = start + need
                self._sizes[start + need] = free - need
            self._used[start] = need
            self.used_bytes += need
            return start
        return None

    def take(self, offset: int, size: int) -> bool:
        """Allocate exactly the range at `offset` for `size` bytes if all of it is free (re-adopting an
        object a previous server left); False otherwise, and nothing changes."""
        need = _round(size)
        if offset % ALIGN or offset < self.base or offset + need > self.base + self.capacity:
            return False
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0:
            return False
        start = self._starts[i]
        end = start + self._sizes[start]
        if offset + need > end:
            return False
        del self._starts[i]
        del self._sizes[start]
        if offset > start:  # what is left before and after the taken range stays free
            self._starts.insert(i, start)
            self._sizes[start] = offset - start
            i += 1
        if end > offset + need:
            self._starts.insert(i, offset + need)
            self._sizes[offset + need] = end - offset - need
        self._used[offset] = need
        self.used_bytes += need
        return True

    def free(self, offset: int) -> None:
        size = self._used.pop(offset)
        self.used_bytes -= size
        i = bisect.bisect_left(self._starts, offset)
        start, end = offset, offset + size
        if i < len(self._starts) and self._starts[i] == end:  # merge with the next free range
            end += self._sizes.pop(self._starts.pop(i))
        if i > 0 and self._starts[i - 1] + self._sizes[self._starts[i - 1]] == start:  # and the previous
            prev = self._starts[i - 1]
            self._sizes[prev] += end - start
            return
        self._starts.insert(i, start)
        self._sizes[start] = end - start

    def largest_free(self) -> int:
        return max(self._sizes.values(), default=0)
