"""Object allocation over the arena: one exact-size extent per object, reused by exact fit.

Why not slabs of equal slots: a freed slot only returned to the arena when its whole slab was
empty, so one object of a new size (another model or layout on the same server) had to evict a
whole slab's worth of objects scattered across the arena (measured: one 3 MiB reservation evicted
240 of 255 resident 1 MiB objects). Here every object is a 4 KiB-aligned extent. Objects of one
size still tile the arena exactly (a freed extent is reused whole, found by exact fit), and when
sizes mix the caller frees a contiguous window around its eviction victim (`window`), so a
reservation evicts what it needs plus at most one object, never the arena.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

ALIGN = 4096


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class ExtentAllocator:
    """Free extents kept sorted by start and indexed by length: exact fit first, then first fit."""

    def __init__(self, size: int, base: int = 0) -> None:
        self._starts: list[int] = []
        self._lengths: dict[int, int] = {}
        self._by_len: dict[int, set[int]] = {}
        self._add(base, size)

    def alloc(self, length: int) -> int | None:
        exact = self._by_len.get(length)
        if exact:
            start = min(exact)  # lowest address: keeps the arena packed from its start
            self._remove(start)
            return start
        for start in self._starts:
            have = self._lengths[start]
            if have >= length:
                self._remove(start)
                if have > length:
                    self._add(start + length, have - length)
                return start
        return None

    def take(self, start: int, length: int) -> bool:
        """Allocate exactly [start, start + length) if it lies in one free extent (re-adopting a slot)."""
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0:
            return False
        have = self._starts[i]
        end = have + self._lengths[have]
        if start + length > end:
            return False
        self._remove(have)
        if start > have:
            self._add(have, start - have)
        if end > start + length:
            self._add(start + length, end - start - length)
        return True

    def free(self, start: int, length: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        if i > 0:
            prev = self._starts[i - 1]
            prev_len = self._lengths[prev]
            if prev + prev_len == start:
                self._remove(prev)
                start, length = prev, length + prev_len
        nxt = start + length
        if nxt in self._lengths:
            length += self._lengths[nxt]
            self._remove(nxt)
        self._add(start, length)

    def free_bytes(self) -> int:
        return sum(self._lengths.values())

    def extent_at(self, start: int) -> int | None:
        """Length of the free extent starting exactly at `start`, or None."""
        return self._lengths.get(start)

    def extent_ending_at(self, end: int) -> int | None:
        """Start of the free extent ending exactly at `end`, or None."""
        i = bisect.bisect_left(self._starts, end)
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._lengths[prev] == end:
                return prev
        return None

    def _add(self, start: int, length: int) -> None:
        bisect.insort(self._starts, start)
        self._lengths[start] = length
        self._by_len.setdefault(length, set()).add(start)

    def _remove(self, start: int) -> None:
        self._starts.pop(bisect.bisect_left(self._starts, start))
        length = self._lengths.pop(start)
        same = self._by_len[length]
        same.discard(start)
        if not same:
            del self._by_len[length]


class ArenaAllocator:
    """alloc(size) -> offset or None; free(offset). Offsets lie in [base, base + capacity)."""

    def __init__(self, capacity: int, base: int = 0) -> None:
        self.capacity = capacity
        self.base = base
        self.end = base + capacity
        self._extents = ExtentAllocator(capacity, base)
        self._used: dict[int, int] = {}  # allocated offset -> extent length
        self._ends: dict[int, int] = {}  # allocated extent end -> its offset (walking left)
        self.used_bytes = 0

    @staticmethod
    def slot_size(size: int) -> int:
        return _round_up(size, ALIGN)

    def alloc(self, size: int) -> int | None:
        length = self.slot_size(size)
        offset = self._extents.alloc(length)
        if offset is not None:
            self._used[offset] = length
            self._ends[offset + length] = offset
            self.used_bytes += length
        return offset

    def take(self, offset: int, size: int) -> bool:
        """Allocate the slot at `offset` for an object of `size` bytes, if all of it is free."""
        length = self.slot_size(size)
        if offset % ALIGN or offset < self.base or offset + length > self.end or not self._extents.take(offset, length):
            return False
        self._used[offset] = length
        self._ends[offset + length] = offset
        self.used_bytes += length
        return True

    def free(self, offset: int) -> None:
        length = self._used.pop(offset)
        del self._ends[offset + length]
        self.used_bytes -= length
        self._extents.free(offset, length)

    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    def length_of(self, offset: int) -> int:
        return self._used[offset]

    def hole_at(self, offset: int) -> tuple[int, int]:
        """The free extent (start, end) that contains `offset` (an offset just freed)."""
        i = bisect.bisect_right(self._extents._starts, offset) - 1
        start = self._extents._starts[i]
        return start, start + self._extents._lengths[start]

    def right_of(self, pos: int) -> Iterator[tuple[int, int, bool]]:
        """Segments (start, length, allocated) from `pos` rightwards, in address order."""
        while pos < self.end:
            if pos in self._used:
                length, used = self._used[pos], True
            else:
                free = self._extents.extent_at(pos)
                if free is None:
                    return
                length, used = free, False
            yield pos, length, used
            pos += length

    def left_of(self, pos: int) -> Iterator[tuple[int, int, bool]]:
        """Segments (start, length, allocated) ending at `pos` and leftwards, in reverse address order."""
        while pos > self.base:
            start = self._ends.get(pos)
            used = start is not None
            if start is None:
                start = self._extents.extent_ending_at(pos)
                if start is None:
                    return
            yield start, pos - start, used
            pos = start


SlabAllocator = ArenaAllocator  # the old name, kept for callers outside this package
