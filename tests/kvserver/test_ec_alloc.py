"""The EC segment's first-fit allocator: no overlap, full coalescing, exact accounting."""

from __future__ import annotations

import itertools
import random

from kvserver.ec.alloc import ALIGN, FirstFitAllocator


def test_random_alloc_free_never_overlaps_and_coalesces() -> None:
    rng = random.Random(7)
    a = FirstFitAllocator(1 << 20, base=4096)
    live: dict[int, int] = {}
    for _ in range(5000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            a.free(off)
            del live[off]
        else:
            size = rng.randrange(1, 40_000)
            off = a.alloc(size)
            if off is None:
                assert a.largest_free() < size
                continue
            assert off % ALIGN == 0 and off >= 4096 and off + size <= 4096 + (1 << 20)
            live[off] = size
        spans = sorted((o, o + (s + ALIGN - 1) // ALIGN * ALIGN) for o, s in live.items())
        assert all(e1 <= s2 for (_, e1), (s2, _) in itertools.pairwise(spans))
        assert a.used_bytes == sum(e - s for s, e in spans)
    for off in list(live):
        a.free(off)
    assert a.used_bytes == 0 and a.largest_free() == 1 << 20  # everything merged back into one range
