"""A bounded negative cache for L2 lookups: (tier, key) pairs a tier just said it lacks.

Why: every L1 miss used to ask every tier again, so a prefix nobody stored costs a round trip per
tier on every lookup. An absent answer is remembered for a short TTL (other servers sharing the
tier may store the key meanwhile, so it must not be remembered for long) and forgotten at once when
this server writes the key to that tier. Oldest entries go first when the bound is reached.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable


class NegativeCache:
    def __init__(self, ttl: float, max_entries: int = 65536) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._until: OrderedDict[tuple[int, str], float] = OrderedDict()
        self.hits = 0  # tier round trips saved, per key

    @property
    def enabled(self) -> bool:
        return self.ttl > 0 and self.max_entries > 0

    def absent(self, tier: int, key: str, now: float | None = None) -> bool:
        """Whether `tier` is known to lack `key` (counted as a hit when so)."""
        until = self._until.get((tier, key))
        if until is None:
            return False
        if until <= (time.monotonic() if now is None else now):
            del self._until[(tier, key)]
            return False
        self.hits += 1
        return True

    def remember(self, tier: int, keys: Iterable[str]) -> None:
        if not self.enabled:
            return
        until = time.monotonic() + self.ttl
        for key in keys:
            self._until[(tier, key)] = until
            self._until.move_to_end((tier, key))
        while len(self._until) > self.max_entries:
            self._until.popitem(last=False)

    def forget(self, tier: int, keys: Iterable[str]) -> None:
        if self._until:
            for key in keys:
                self._until.pop((tier, key), None)

    def __len__(self) -> int:
        return len(self._until)
