"""The L2 prefetcher in-process, on a real arena and a real fs tier: concurrent runs share loads,
a gap in L2 ends the prefix, a corrupt object is a counted miss that is deleted, and no run leaves
a lease or an in-flight record behind."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from kvprotocol import ObjectKey
from kvserver.l1.arena import Arena
from kvserver.l1.eviction import LRUPolicy
from kvserver.l1.cache import L1Cache, State
from kvserver.l2.fs import FsAdapter
from kvserver.l2.keys import key_str
from kvserver.l2.negcache import NegativeCache
from kvserver.l2.prefetch import Prefetcher
from kvserver.l2.serde import Serde
from kvserver.l2.tier import Tier
from kvserver.l1.slab import ALIGN

SIZE = ALIGN  # one object per chunk, one slab each


def key(i: int) -> ObjectKey:
    return ObjectKey("m", "0" * 16, 1, 0, 0, "", bytes([i]) * 32)


def payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8).tobytes()


class Rig:
    def __init__(self, tmp: Path) -> None:
        self.arena = Arena(f"kvserver-unit-prefetch-{tmp.name}"[:60], 16 * SIZE)
        self.l1 = L1Cache(self.arena, LRUPolicy())
        self.adapter = FsAdapter(tmp / "l2")
        self.tier = Tier(self.adapter)
        self.serde = Serde()
        self.promoted: list[tuple[list, tuple[int, ...]]] = []
        self.pf = Prefetcher(
            self.l1,
            [self.tier],
            self.serde,
            NegativeCache(1.0),
            [],
            lambda keys, tiers: self.promoted.append((list(keys), tiers)),
        )

    async def put(self, *indexes: int) -> None:
        await self.adapter.start()
        await self.adapter.put(
            [(key_str(key(i)), self.serde.encode(key_str(key(i)), payload(i), 1000 + i)) for i in indexes]
        )

    async def run(self, n: int, timeout: float = 5.0) -> None:
        await self.pf.run([[key(i)] for i in range(n)], 0, lambda _k: SIZE, timeout)
        while self.pf.background:  # loads are tasks of their own: let them finish
            await asyncio.sleep(0.01)

    def assert_clean(self) -> None:
        assert not self.pf.inflight and not self.pf.waiting
        assert all(e.leases == 0 for e in self.l1.entries.values())
        assert all(e.state is State.READY for e in self.l1.entries.values())

    def close(self) -> None:
        self.arena.close()


@pytest.fixture
def rig(tmp_path: Path):
    r = Rig(tmp_path)
    yield r
    r.close()


def test_concurrent_runs_load_each_object_once_with_its_bytes_and_checksum(rig: Rig) -> None:
    async def go() -> None:
        await rig.put(0, 1, 2)
        await asyncio.gather(rig.run(3), rig.run(3), rig.run(2))

    asyncio.run(go())
    assert rig.pf.loaded == 3 and rig.tier.stats.gets == 3  # the later runs waited on the first's loads
    for i in range(3):
        entry = rig.l1.ready(key(i))
        assert entry is not None and entry.checksum == 1000 + i
        assert bytes(rig.arena.read(entry.offset, entry.size)) == payload(i)
    rig.assert_clean()
    assert rig.promoted == []  # loaded from the top tier: nothing to promote


def test_a_gap_in_l2_ends_the_prefix(rig: Rig) -> None:
    async def go() -> None:
        await rig.put(0, 2)  # chunk 1 is nowhere
        await rig.run(3)

    asyncio.run(go())
    assert rig.l1.ready(key(0)) is not None
    assert key(1) not in rig.l1.entries and key(2) not in rig.l1.entries  # never loaded past the gap
    assert rig.pf.loaded == 1
    rig.assert_clean()


def test_a_corrupt_object_is_a_counted_miss_and_is_deleted(rig: Rig) -> None:
    async def go() -> None:
        await rig.put(0, 1)
        path = next(
            p
            for p in (rig.adapter.root / "objects").rglob("*")
            if p.is_file() and p.read_bytes() == rig.serde.encode(key_str(key(1)), payload(1), 1001)
        )
        blob = bytearray(path.read_bytes())
        blob[-1] ^= 0xFF
        path.write_bytes(bytes(blob))
        await rig.run(2)
        assert await rig.adapter.contains([key_str(key(1))]) == [False]  # deleted

    asyncio.run(go())
    assert rig.l1.ready(key(0)) is not None and key(1) not in rig.l1.entries
    assert rig.tier.stats.corrupt == 1
    rig.assert_clean()
