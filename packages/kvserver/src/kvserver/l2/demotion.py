"""Which objects L1 evicts are worth writing to L2 (demotion), from what L1 saw of them.

Why: with a bounded L2 below L1, L2 should hold what L1 cannot, not a second copy of what L1 has.
Writing on eviction instead of on commit keeps the tiers nearly exclusive; the L2 directory
(directory.py) skips objects L2 already holds, so those cost nothing to drop. Modes:
`evicted` writes every victim L2 lacks; `hit` only victims a lookup hit in L1 while resident (a
prefix read at least twice is likelier to come back than one stored once), fewer writes for some
hit rate. The set of hit keys is bounded by what L1 holds: a key leaves it when L1 drops it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

MODES = ("evicted", "hit")


class Demotion:
    def __init__(self, mode: str = "evicted") -> None:
        if mode not in MODES:
            raise ValueError(f"demotion must be one of {list(MODES)}")
        self.mode = mode
        self._hit: set[Hashable] = set()
        self.admitted = 0
        self.declined = 0

    def hit(self, keys: Iterable[Hashable]) -> None:
        """Keys a lookup hit in L1."""
        if self.mode == "hit":
            self._hit.update(keys)

    def admit(self, key: Hashable) -> bool:
        """Whether an object L1 evicts (and L2 lacks) should be written to L2."""
        ok = self.mode == "evicted" or key in self._hit
        self.admitted += ok
        self.declined += not ok
        return ok

    def forget(self, key: Hashable) -> None:
        """L1 no longer holds `key`."""
        self._hit.discard(key)
