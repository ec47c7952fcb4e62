"""PrefixIndex unit behaviour: owners of shared chunks, prefixes that stop at holes, clears, and
structures the garbage collector does not walk (10 M keys must not stall the coordinator's loop)."""

from __future__ import annotations

import gc

from kvcoordinator.index import PrefixIndex, low64, model_tag


def test_prefixes_follow_each_instance_until_its_first_missing_chunk() -> None:
    idx = PrefixIndex()
    keys = idx.keys("m", [bytes([i]) * 32 for i in range(5)])
    idx.add(0, keys[:5])
    idx.add(1, keys[:2])
    idx.add(2, [keys[0], keys[2], keys[3]])  # a hole at chunk 1 ends its prefix at 1
    idx.add(700, keys[:3])  # slots beyond 64 bits of bitmap
    assert idx.prefixes(keys) == {0: 5, 1: 2, 2: 1, 700: 3}
    assert idx.prefixes(idx.keys("other-model", [bytes([i]) * 32 for i in range(5)])) == {}
    idx.remove(0, [keys[1]])
    assert idx.prefixes(keys) == {0: 1, 1: 2, 2: 1, 700: 3}
    assert idx.clear(700) == 3 and idx.prefixes(keys) == {0: 1, 1: 2, 2: 1}
    idx.remove(1, keys)  # back to a single owner per key: the bitmap collapses to the slot
    idx.remove(2, keys)
    assert idx.prefixes(keys) == {0: 1} and len(idx) == 4  # slot 0 still holds chunks 0, 2, 3, 4
    idx.remove(5, keys)  # unknown slot: nothing
    idx.remove(0, [keys[1]])  # not held: nothing
    assert idx.clear(0) == 4 and len(idx) == 0 and idx.prefixes(keys) == {}


def test_a_slot_only_removes_its_own_claims() -> None:
    idx = PrefixIndex()
    k = idx.keys("m", [b"\x01" * 32])
    idx.add(3, k)
    idx.remove(4, k)
    idx.clear(4)
    assert idx.prefixes(k) == {3: 1}


def test_hash_forms_and_model_tags() -> None:
    h = bytes(range(32))
    assert low64(h) == low64(int.from_bytes(h, "big")) == int.from_bytes(h[-8:], "big")
    assert PrefixIndex().keys("m", [h]) == [low64(h) ^ model_tag("m")]
    assert model_tag("a") != model_tag("b")


def test_the_index_structures_are_not_walked_by_the_garbage_collector() -> None:
    idx = PrefixIndex()
    for slot in range(3):
        idx.add(slot, range(slot * 1000, slot * 1000 + 5000))
    gc.collect()
    assert not gc.is_tracked(idx._owners)
    assert not any(gc.is_tracked(held) for held in idx._held.values())
