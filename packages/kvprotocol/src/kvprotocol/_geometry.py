"""Per-group chunk geometry: which objects of one KV cache group a hit, a store and a load involve.

One definition shared by the server (what a lookup requires, what a store reserves, what a retrieve
returns) and the engine client (what it expects back and which blocks it copies), so both sides
always name the same objects.

Tokens are counted in *units* of the server's chunk size U (the rolling chunk hash is taken per
unit, so the hash of unit c names the whole prefix [0, (c+1)U)). A group whose layout has
`chunk_size = k * U` keys object j, which holds tokens [j*k*U, (j+1)*k*U), under the hash of its
last unit, `c = (j+1)*k - 1`; the wire's `chunk` field of an object is that unit index c. With
k = 1 (every layout today) object j is unit chunk j, exactly as before.

What a hit of t units (tokens [0, T), T = t*U) needs of each group kind:
- full: every object overlapping [0, T) (the last one may be used in part);
- sliding (window W tokens): attention never reads further back than W tokens, so the prefix before
  the window need not be cached at all. The group's object at T is a *window snapshot*: the
  ceil(W / block_size) blocks ending at T (slots before token 0 are zeros). A hit at T needs exactly
  that snapshot. Why a snapshot and not the chunks overlapping the window: an engine (vLLM) frees
  the blocks that fell out of the window, so at a store only the last window is sure to hold valid
  KV; a chunk object reaching further back could carry freed blocks that a later, shorter hit would
  read. A snapshot is written only from the window its store holds, and read only at its own T.
- state (a recurrent Mamba/GDN state after its chunk's last token): exactly the object ending at T,
  and only when T is one of its boundaries. A state never bridges a gap: the state at 512 tokens
  says nothing about the state at 768.
Sliding and state groups ("exact" kinds) are thus stored only at the end of a store (the boundary
the engine has just computed) and usable only at exactly that boundary. The reusable prefix is the
largest t for which every group has everything it needs; for exact kinds this is not monotone in
t, so the fold checks candidates from the longest down.

An object of any kind is "the blocks_per_chunk blocks ending at token (c+1)*U" for its end unit c:
for a full object that is its chunk, for a snapshot its window, for a state its chunk.
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

    @property
    def exact(self) -> bool:
        """Usable only at exactly its boundary (sliding snapshots, recurrent states)."""
        return self.kind != "full"

    def needed(self, t: int, unit: int) -> range:
        """Object indices a hit of t >= 1 units needs (an empty range: impossible for this group)."""
        k = self.units
        if self.exact:
            return range(t // k - 1, t // k) if t % k == 0 else range(0)
        return range(0, -(-t // k))

    def stored(self, start: int, n: int, unit: int) -> range:
        """Object indices a store of unit chunks [start, n) writes: of a full group every complete
        object ending at or after unit `start`; of an exact kind only the one ending at n (if any)."""
        k = self.units
        first, end = -(-(start + 1) // k) - 1, n // k
        if self.exact:
            return range(end - 1, end) if n % k == 0 and end - 1 >= max(first, 0) else range(0)
        return range(max(first, 0), end)

    def overlapping(self, objs: range, start: int, end: int) -> range:
        """The objects of `objs` holding tokens of units [start, end) (an exact kind: its one object)."""
        if self.exact:
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
