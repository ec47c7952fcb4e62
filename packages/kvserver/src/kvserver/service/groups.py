"""Per-group geometry on the server: which objects a hit needs, a store writes and a retrieve returns.

Why its own module: a keyspace whose groups are all plain full attention (one object per chunk,
one per rank: every engine before hybrid models) keeps cache.py's original loops untouched; a
keyspace with a sliding window, a recurrent state, another chunk size or an MLA group shared by all
ranks goes through `KeyPlan`, built on kvprotocol's one definition of the geometry
(kvprotocol._geometry). The geometry of a group is learned from engine registrations and is a pure
function of its layout fingerprint (the fingerprint hashes kind, window, shared and chunk size), so
no registration can change what another tenant's keys mean. A keyspace naming a fingerprint no
engine registered is planned as full attention: nothing was ever stored under it, so it misses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvprotocol import SHARED_RANK, GroupGeometry, KeySpace, LayoutDescriptor, ObjectKey, prefix_hit

from .leases import rank_keys

Obj = tuple[int, int, ObjectKey]  # (unit chunk the object ends at, group, key)

FULL = GroupGeometry()
PLAN_MEMO = 1024


@dataclass(frozen=True, slots=True)
class KeyPlan:
    ks: KeySpace
    geoms: tuple[GroupGeometry, ...]
    unit: int

    def key(self, group: int, rank: int, salt: str, chunk_hash: bytes) -> ObjectKey:
        model, world, fps = self.ks
        r = SHARED_RANK if self.geoms[group].shared else rank
        return tuple.__new__(ObjectKey, (model, fps[group], world, r, group, salt, chunk_hash))  # hot: see ObjectKey

    def ranks(self, group: int) -> range:
        """The ranks that hold their own object of a group (a shared group: the sentinel alone)."""
        return range(SHARED_RANK, SHARED_RANK + 1) if self.geoms[group].shared else range(self.ks[1])

    def hit(self, salt: str, hashes: list[bytes], ready: Callable[[ObjectKey], object]) -> int:
        """Hit units: every group's needed objects ready for every rank (see kvprotocol.prefix_hit)."""

        def present(g: int, c: int) -> bool:
            return all(ready(self.key(g, r, salt, hashes[c])) is not None for r in self.ranks(g))

        return prefix_hit(self.geoms, len(hashes), self.unit, present)

    def needed(
        self, salt: str, hashes: list[bytes], hit: int, rank: int | None, start: int = 0, end: int | None = None
    ) -> list[tuple[int, int, ObjectKey]]:
        """(end unit, group, key) of every object a hit of `hit` units needs, in unit order, for one
        rank (None: every rank); restricted to the objects holding tokens of units [start, end)."""
        if hit <= 0:
            return []
        out = []
        for g, geo in enumerate(self.geoms):
            objs = geo.overlapping(geo.needed(hit, self.unit), start, hit if end is None else end)
            ranks = self.ranks(g) if rank is None or geo.shared else (rank,)
            out += [(geo.end_unit(j), g, self.key(g, r, salt, hashes[geo.end_unit(j)])) for j in objs for r in ranks]
        out.sort(key=lambda o: (o[0], o[1]))
        return out

    def touch_hit(
        self,
        salt: str,
        hashes: list[bytes],
        hit: int,
        touch: Callable[[ObjectKey], object],
        on_hit: list[Callable[[list[ObjectKey]], None]],
    ) -> None:
        """A lookup's bookkeeping: touch what the hit needs (tail first) and tell the hooks."""
        keys = [k for _, _, k in self.needed(salt, hashes, hit, None)]
        for key in reversed(keys):
            touch(key)
        if on_hit and hit:
            for hook in on_hit:
                hook(keys)

    def lease_keys(self, salt: str, hashes: list[bytes], hit: int) -> Callable[[int], list[ObjectKey]]:
        """The function that names one rank's objects of a hit, for its leases."""
        return lambda rank: [k for _, _, k in self.needed(salt, hashes, hit, rank)]

    def stored(self, rank: int, salt: str, hashes: list[bytes], start: int) -> list[tuple[int, int, ObjectKey]]:
        """(end unit, group, key) of the objects a store of units [start, len(hashes)) by `rank` writes."""
        out = []
        for g, geo in enumerate(self.geoms):
            out += [
                (geo.end_unit(j), g, self.key(g, rank, salt, hashes[geo.end_unit(j)]))
                for j in geo.stored(start, len(hashes), self.unit)
            ]
        out.sort(key=lambda o: (o[0], o[1]))
        return out

    def prefetch_sets(self, salt: str, hashes: list[bytes]) -> list[list[ObjectKey]]:
        """What an L2 prefetch may load, each list useful only whole: per unit, the full groups'
        objects ending there, and each exact group's object ending there on its own."""
        out: list[list[ObjectKey]] = []
        for c, h in enumerate(hashes):
            full: list[ObjectKey] = []
            for g, geo in enumerate(self.geoms):
                if (c + 1) % geo.units:
                    continue
                keys = [self.key(g, r, salt, h) for r in self.ranks(g)]
                if geo.exact:
                    out.append(keys)
                else:
                    full += keys
            if full:
                out.append(full)
        return out

    def ending_at(self, salt: str, chunk_hash: bytes, c: int) -> list[ObjectKey]:
        """Every rank's objects of every group that end at unit c (query, pin, prefetch)."""
        return [
            self.key(g, r, salt, chunk_hash)
            for g, geo in enumerate(self.geoms)
            if (c + 1) % geo.units == 0
            for r in self.ranks(g)
        ]


class GroupBook:
    """Layout fingerprint -> geometry, from registrations; plans for keyspaces that need one."""

    def __init__(self, unit: int) -> None:
        self.unit = unit
        self.geoms: dict[str, GroupGeometry] = {}
        self._plans: dict[KeySpace, KeyPlan | None] = {}  # memo: lookups call plan() per chunk

    def add(self, layout: LayoutDescriptor) -> None:
        geo = GroupGeometry.of(layout, self.unit)
        if not geo.trivial and layout.fingerprint not in self.geoms:
            self.geoms[layout.fingerprint] = geo
            self._plans.clear()

    def forget(self, fingerprints: list[str]) -> None:
        """Layouts no longer registered (layout_book.py): their keyspaces plan as full attention."""
        if any(self.geoms.pop(fp, None) is not None for fp in fingerprints):
            self._plans.clear()

    def plan(self, ks: KeySpace) -> KeyPlan | None:
        """None when every group is plain full attention (the original per-chunk rule applies)."""
        if not self.geoms:
            return None
        if ks in self._plans:
            return self._plans[ks]
        geoms = tuple(self.geoms.get(fp, FULL) for fp in ks[2])
        plan = None if all(g.trivial for g in geoms) else KeyPlan(ks, geoms, self.unit)
        if len(self._plans) >= PLAN_MEMO:  # keyspaces come from clients: the memo stays bounded
            self._plans.clear()
        self._plans[ks] = plan
        return plan

    def store_objects(self, ks: KeySpace, salt: str, rank: int, hashes: list[bytes], start: int) -> list[Obj]:
        """What a store by `rank` of units [start, len(hashes)) reserves, in unit order."""
        plan = self.plan(ks)
        if plan is None:
            return [
                (c, g, k)
                for c in range(start, len(hashes))
                for g, k in enumerate(rank_keys(ks, salt, rank, [hashes[c]]))
            ]
        return plan.stored(rank, salt, hashes, start)

    def retrieve_objects(
        self, ks: KeySpace, salt: str, hashes: list[bytes], hit: int, rank: int, start: int, end: int
    ) -> list[Obj]:
        """What a retrieve of units [start, end) by `rank` returns of a hit of `hit` units."""
        plan = self.plan(ks)
        if plan is None:
            return [(c, g, k) for c in range(start, end) for g, k in enumerate(rank_keys(ks, salt, rank, [hashes[c]]))]
        return plan.needed(salt, hashes, hit, rank, start, end)
