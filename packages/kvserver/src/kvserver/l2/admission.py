"""Admission to L2: which committed objects are worth writing below L1.

`all` writes every commit (the default). `second-hit` holds a committed object back until a lookup
hits it in L1 once (its second use), so one-hit wonders, the prefixes nobody asks for again, never
cost an L2 write; an object evicted from L1 before its second use is never written. `tinylfu` also
remembers uses beyond L1 residency in a small count-min sketch (TinyLFU, Einziger et al.): an
object committed again after its eviction has been seen before and is written at once. Held-back
keys live in a bounded table; the oldest are forgotten (never written) when it is full.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvprotocol import ObjectKey


MODES = ("all", "second-hit", "tinylfu")


class FrequencySketch:
    """Count-min sketch of 4 rows with saturating byte counters, halved every `window` additions so
    old popularity fades (TinyLFU's reset)."""

    def __init__(self, width: int = 1 << 16, window: int = 1 << 20) -> None:
        self.width = width
        self.window = window
        self.rows = [bytearray(width) for _ in range(4)]
        self.added = 0

    def _slots(self, key: object) -> list[int]:
        h = hash(key)
        return [((h >> (16 * i)) ^ (h * (2 * i + 1))) % self.width for i in range(4)]

    def add(self, key: object) -> None:
        for row, slot in zip(self.rows, self._slots(key), strict=True):
            if row[slot] < 255:
                row[slot] += 1
        self.added += 1
        if self.added >= self.window:
            self.added = 0
            for row in self.rows:
                row[:] = bytes(b >> 1 for b in row)

    def estimate(self, key: object) -> int:
        return min(row[slot] for row, slot in zip(self.rows, self._slots(key), strict=True))


class Admission:
    def __init__(self, mode: str = "all", max_pending: int = 1 << 18) -> None:
        if mode not in MODES:
            raise ValueError(f"l2 admission must be one of {list(MODES)}")
        self.mode = mode
        self.max_pending = max_pending
        self._pending: OrderedDict[ObjectKey, None] = OrderedDict()
        self.sketch = FrequencySketch() if mode == "tinylfu" else None
        self.admitted = 0  # objects passed on to the write-behind queue
        self.deferred = 0  # objects held back at commit
        self.forgotten = 0  # held-back objects dropped from the bounded table (never written)

    def on_commit(self, keys: Iterable[ObjectKey]) -> list[ObjectKey]:
        """The committed keys to write now (all of them, or none under `second-hit`)."""
        if self.mode == "all":
            out = list(keys)
            self.admitted += len(out)
            return out
        now = []
        for key in keys:
            if self.sketch is not None:
                seen = self.sketch.estimate(key) > 0
                self.sketch.add(key)
                if seen:
                    now.append(key)
                    continue
            self._pending[key] = None
            self.deferred += 1
        self.admitted += len(now)
        while len(self._pending) > self.max_pending:
            self._pending.popitem(last=False)
            self.forgotten += 1
        return now

    def on_hit(self, keys: Iterable[ObjectKey]) -> list[ObjectKey]:
        """Keys a lookup hit in L1 that were held back: write them now."""
        if self.sketch is not None:
            for k in keys:
                self.sketch.add(k)
        if not self._pending:
            return []
        out = [k for k in keys if self._pending.pop(k, 0) is None]
        self.admitted += len(out)
        return out

    def on_evict(self, key: ObjectKey) -> None:
        """An object left L1 before its second use: it will never be written."""
        if self._pending.pop(key, 0) is None:
            self.forgotten += 1

    def describe(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "admitted": self.admitted,
            "deferred": self.deferred,
            "pending": len(self._pending),
            "forgotten": self.forgotten,
        }
