"""Per-group chunk geometry: which objects of one KV cache group a hit, a store and a load involve.

One definition shared by the server (what a lookup requires, what a store reserves, what a retrieve
returns) and the engine client (what it expects back and which blocks it copies), so both sides
always name the same objects.

Tokens are counted in *units* of the server's chunk size U (the rolling chunk hash is taken per
unit, so the hash of unit c names the whole prefix [0, (c+1)U)). A group whose layout has
`chunk_size = k * U` keys object j, which holds tokens [j*k*U, (j+1)*k*U), under the hash of its
last unit, `c = (j+1)*k - 1`; the wire's `chunk` field of an object is that unit index c. With
k = 1 (every layout today) object j is unit chunk j, exactly as before.

What a hit of t units (tokens [0, t*U)) needs of each group kind:
- full: every object overlapping [0, tU) (the last one may be used in part);
- sliding (window W tokens): only the objects overlapping [tU - W, tU): attention never reads further
  back, so the prefix before the window need not be cached at all;
- state (a recurrent Mamba/GDN state after its chunk's last token): exactly the object that ends at
  tU, and only when tU is one of its boundaries. A state never bridges a gap: the state at 512
  tokens says nothing about the state at 768.
The reusable prefix is the largest t for which every group has everything it needs; for sliding and
state groups this is not monotone in t, so the fold checks candidates from the longest down.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ._keys import SHARED_RANK
from ._layout import LayoutDescriptor

__all__ = ["SHARED_RANK", "GroupGeometry", "prefix_hit"]


@dataclass(frozen=True, slots=True)
class GroupGeometry:
    kind: str = "full"
    units: int = 1  # server chunks per object
    window: int = 0  # tokens (sliding)
    shared: bool = False

    @classmethod
    def of(cls, layout: LayoutDescriptor, unit: int) -> GroupGeometry:
        if layout.chunk_size % unit:
            raise ValueError(f"layout chunk_size {layout.chunk_size} is not a multiple of the chunk unit {unit}")
        return cls(layout.kind, layout.chunk_size // unit, layout.window, layout.shared)

    @property
    def trivial(self) -> bool:
        """Full attention, one object per unit, one per rank: the plain prefix rule of every chunk."""
        return self.kind == "full" and self.units == 1 and not self.shared

    def end_unit(self, j: int) -> int:
        return (j + 1) * self.units - 1

    def needed(self, t: int, unit: int) -> range:
        """Object indices a hit of t >= 1 units needs (an empty range: impossible for this group)."""
        k = self.units
        last = -(-t // k)
        if self.kind == "state":
            return range(t // k - 1, t // k) if t % k == 0 else range(0)
        if self.kind == "sliding":
            return range(max(0, t * unit - self.window) // (k * unit), last)
        return range(0, last)

    def stored(self, start: int, n: int, unit: int) -> range:
        """Object indices a store of unit chunks [start, n) (tokens [0, n*U) known) writes: every
        complete object ending at or after unit `start`; of a sliding group only those overlapping the
        last window before n*U; of a state group only the state at n*U."""
        k = self.units
        first, end = -(-(start + 1) // k) - 1, n // k
        if self.kind == "state":
            return range(end - 1, end) if n % k == 0 and end - 1 >= max(first, 0) else range(0)
        if self.kind == "sliding":
            first = max(first, max(0, n * unit - self.window) // (k * unit))
        return range(max(first, 0), end)

    def overlapping(self, objs: range, start: int, end: int) -> range:
        """The objects of `objs` that hold any token of units [start, end) (a state: its one object)."""
        if self.kind == "state":
            return objs
        k = self.units
        lo, hi = max(objs.start, start // k), min(objs.stop, -(-end // k))
        return range(lo, max(lo, hi))


def prefix_hit(geoms: Sequence[GroupGeometry], n: int, unit: int, present: Callable[[int, int], bool]) -> int:
    """Largest t <= n (units) such that every group has every object a hit of t needs.

    `present(group, end_unit)` says whether that group's object ending at unit end_unit is cached (for
    every rank). Full groups bound t by their longest cached prefix; the others are checked per
    candidate from the longest down.
    """
    limit = n
    for g, geo in enumerate(geoms):
        if geo.kind != "full":
            continue
        j = 0
        while geo.end_unit(j) < n and present(g, geo.end_unit(j)):
            j += 1
        limit = min(limit, j * geo.units)
    others = [(g, geo) for g, geo in enumerate(geoms) if geo.kind != "full"]
    for t in range(limit, 0, -1):
        if all(_has(geo, g, t, n, unit, present) for g, geo in others):
            return t
    return 0


def _has(geo: GroupGeometry, g: int, t: int, n: int, unit: int, present: Callable[[int, int], bool]) -> bool:
    objs = geo.needed(t, unit)
    return len(objs) > 0 and geo.end_unit(objs.stop - 1) < n and all(present(g, geo.end_unit(j)) for j in objs)
