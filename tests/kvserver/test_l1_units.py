"""L1 building blocks in isolation: slab allocator reuse and the atomic write-to-read step."""

from __future__ import annotations

import itertools
import random

import pytest

from kvprotocol import ObjectKey
from kvserver.l1.arena import Arena
from kvserver.l1.eviction import LRUPolicy
from kvserver.l1.cache import L1Cache, State
from kvserver.l1.slab import ALIGN, ArenaAllocator as SlabAllocator, ExtentAllocator


def test_extent_allocator_coalesces_back_to_one_extent():
    ext = ExtentAllocator(1000)
    parts = [(ext.alloc(100), 100) for _ in range(10)]
    assert ext.alloc(1) is None
    random.Random(1).shuffle(parts)
    for start, length in parts:
        ext.free(start, length)
    assert ext.alloc(1000) == 0


def test_slabs_return_to_the_arena_and_serve_other_sizes():
    alloc = SlabAllocator(64 * ALIGN)
    small = [alloc.alloc(ALIGN) for _ in range(64)]
    assert None not in small and len(set(small)) == 64
    assert alloc.alloc(ALIGN) is None and alloc.alloc(8 * ALIGN) is None
    for off in small:
        alloc.free(off)
    assert alloc.used_bytes == 0
    big = [alloc.alloc(8 * ALIGN) for _ in range(8)]
    assert None not in big
    assert sorted(big) == [i * 8 * ALIGN for i in range(8)]


def test_objects_never_overlap():
    alloc = SlabAllocator(256 * ALIGN)
    rng = random.Random(7)
    live: dict[int, int] = {}
    for _ in range(2000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            alloc.free(off)
            del live[off]
        else:
            size = rng.choice([100, ALIGN, 3 * ALIGN])
            off = alloc.alloc(size)
            if off is not None:
                live[off] = SlabAllocator.slot_size(size)
        spans = sorted(live.items())
        assert all(a + la <= b for (a, la), (b, _) in itertools.pairwise(spans))
        assert all(off + ln <= 256 * ALIGN for off, ln in spans)


@pytest.fixture
def l1():
    arena = Arena("kvserver-unit-test-l1", 4 * ALIGN)
    yield L1Cache(arena, LRUPolicy())
    arena.close()


def key(i: int) -> ObjectKey:
    return ObjectKey("m", "0" * 16, 1, 0, 0, "", bytes([i]) * 32)


def test_a_leased_object_is_never_evicted(l1):
    for i in range(4):
        assert l1.reserve(key(i), ALIGN) is not None
    assert l1.reserve(key(9), ALIGN) is None  # all writing: nothing evictable
    l1.finish_write(key(0))
    l1.lease(key(0))
    entry = l1.entries[key(0)]
    assert entry.state is State.READY and entry.leases == 1
    for i in (1, 2, 3):
        l1.finish_write(key(i))
    assert l1.reserve(key(10), ALIGN) is not None  # evicts 1 (oldest unleased), never the leased 0
    assert l1.ready(key(0)) is not None and l1.ready(key(1)) is None
    l1.unlease(key(0))
    assert l1.evictable(key(0))


def test_abort_write_frees_the_slot(l1):
    for i in range(4):
        l1.reserve(key(i), ALIGN)
    l1.abort_write(key(2))
    assert l1.entries.get(key(2)) is None
    assert l1.reserve(key(5), ALIGN) is not None


def test_maintained_counts_match_a_scan(l1):
    rng = random.Random(3)
    for _ in range(400):
        k = key(rng.randrange(8))
        e = l1.entries.get(k)
        op = rng.random()
        if e is None:
            l1.reserve(k, ALIGN)
        elif e.state is State.WRITING:
            (l1.finish_write if op < 0.7 else l1.abort_write)(k)
        elif op < 0.3:
            l1.lease(k)
        elif op < 0.6:
            l1.unlease(k)
        elif op < 0.8:
            l1.set_pinned(k, op < 0.7)
        else:
            l1.clear()
        es = l1.entries.values()
        assert l1.count(State.WRITING) == sum(x.state is State.WRITING for x in es)
        assert l1.count(State.READY) == sum(x.state is State.READY for x in es)
        assert l1.leased_objects() == sum(x.leases > 0 for x in es)
        assert l1.pinned_objects() == sum(x.pinned for x in es)


class Recorder(LRUPolicy[ObjectKey]):
    """LRU that writes down the optional lineage calls L1 makes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, ObjectKey, ObjectKey | None]] = []

    def on_reserve(self, key: ObjectKey, parent: ObjectKey | None) -> None:
        self.calls.append(("reserve", key, parent))

    def on_link(self, key: ObjectKey, parent: ObjectKey) -> None:
        self.calls.append(("link", key, parent))

    def on_remove(self, key: ObjectKey) -> None:
        self.calls.append(("remove", key, None))
        super().on_remove(key)


def test_the_policy_learns_which_key_a_reservation_extends_and_forgets_unfinished_ones():
    arena = Arena("kvserver-unit-test-l1-lineage", 4 * ALIGN)
    try:
        policy = Recorder()
        l1 = L1Cache(arena, policy)
        k0, k1 = key(0), key(1)
        assert l1.reserve(k0, ALIGN) is not None
        assert l1.reserve(k1, ALIGN, parent=k0.chunk_hash) is not None
        assert policy.calls == [("reserve", k0, None), ("reserve", k1, k0)]  # the parent as a key of its lane
        l1.abort_write(k1)
        l1.quarantine_write(k0, until=1.0)
        assert policy.calls[2:] == [("remove", k1, None), ("remove", k0, None)]
        for i in (2, 3, 4):  # with k0's quarantined slot the arena is full of writes
            assert l1.reserve(key(i), ALIGN) is not None
        assert l1.reserve(key(9), ALIGN) is None
        assert ("reserve", key(9), None) not in policy.calls  # a failed reservation is never announced
    finally:
        arena.close()


def test_links_learnt_after_a_prefetch_reach_the_policy():
    arena = Arena("kvserver-unit-test-l1-link", 4 * ALIGN)
    try:
        policy = Recorder()
        l1 = L1Cache(arena, policy)
        for i in (1, 2):  # loaded from L2: reserved without a parent, linked afterwards
            l1.reserve(key(i), ALIGN)
            l1.finish_write(key(i))
        l1.link_chain("m", 1, "", [key(0).chunk_hash, key(1).chunk_hash, key(2).chunk_hash])
        assert [c for c in policy.calls if c[0] == "link"] == [("link", key(1), key(0)), ("link", key(2), key(1))]
        assert not l1.evictable(key(1)) and l1.evictable(key(2))  # L1 agrees: 2 extends 1
    finally:
        arena.close()
