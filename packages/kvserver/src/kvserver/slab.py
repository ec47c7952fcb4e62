"""Slab allocation over the arena: fixed-size slots per object size, slabs carved from free extents.

Objects of one layout all have one size, so a slab of equal slots never fragments; an empty slab
goes back to the arena so memory can move between sizes.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

ALIGN = 4096
SLAB_TARGET = 32 << 20


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class ExtentAllocator:
    """First-fit over sorted free extents, coalescing on free."""

    def __init__(self, size: int, base: int = 0) -> None:
        self._starts: list[int] = [base]
        self._lengths: dict[int, int] = {base: size}

    def alloc(self, length: int) -> int | None:
        for start in self._starts:
            have = self._lengths[start]
            if have >= length:
                self._remove(start)
                if have > length:
                    self._add(start + length, have - length)
                return start
        return None

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

    def _add(self, start: int, length: int) -> None:
        bisect.insort(self._starts, start)
        self._lengths[start] = length

    def _remove(self, start: int) -> None:
        self._starts.pop(bisect.bisect_left(self._starts, start))
        del self._lengths[start]


@dataclass(slots=True)
class _Slab:
    base: int
    slots: int
    free: list[int] = field(default_factory=list)  # free slot indices


class SlabAllocator:
    """alloc(size) -> offset or None; free(offset). Offsets lie in [base, base + capacity)."""

    def __init__(self, capacity: int, base: int = 0) -> None:
        self.capacity = capacity
        self._extents = ExtentAllocator(capacity, base)
        self._classes: dict[int, list[_Slab]] = {}  # slot size -> slabs with free slots
        self._slab_of: dict[int, tuple[int, _Slab]] = {}  # slab base -> (slot size, slab)
        self._owner: dict[int, tuple[int, _Slab]] = {}  # allocated offset -> (slot size, slab)
        self.used_bytes = 0

    @staticmethod
    def slot_size(size: int) -> int:
        return _round_up(size, ALIGN)

    def alloc(self, size: int) -> int | None:
        slot = self.slot_size(size)
        partial = self._classes.setdefault(slot, [])
        if not partial:
            slots = max(1, SLAB_TARGET // slot)
            base = self._extents.alloc(slots * slot)
            if base is None and slots > 1:
                slots, base = 1, self._extents.alloc(slot)  # tight arena: fall back to a one-slot slab
            if base is None:
                return None
            slab = _Slab(base, slots, list(range(slots - 1, -1, -1)))
            self._slab_of[base] = (slot, slab)
            partial.append(slab)
        slab = partial[-1]
        index = slab.free.pop()
        if not slab.free:
            partial.pop()
        offset = slab.base + index * slot
        self._owner[offset] = (slot, slab)
        self.used_bytes += slot
        return offset

    def free(self, offset: int) -> None:
        slot, slab = self._owner.pop(offset)
        self.used_bytes -= slot
        if not slab.free:
            self._classes[slot].append(slab)
        slab.free.append((offset - slab.base) // slot)
        if len(slab.free) == slab.slots:
            self._classes[slot].remove(slab)
            del self._slab_of[slab.base]
            self._extents.free(slab.base, slab.slots * slot)
