"""Eviction order of each policy, and that non-evictable keys are always skipped."""

from __future__ import annotations

import pytest

from kvserver.l1.eviction import POLICIES, ARCPolicy, LFUPolicy, LRUPolicy, S3FIFOPolicy, make_policy

from policy_helpers import ALL, drain


def test_lru_evicts_least_recently_used():
    p = LRUPolicy()
    for k in "abcd":
        p.on_insert(k)
    p.on_access("a")
    assert drain(p) == ["b", "c", "d", "a"]


def test_lfu_evicts_least_frequent_then_oldest():
    p = LFUPolicy()
    for k in "abcd":
        p.on_insert(k)
    for _ in range(3):
        p.on_access("a")
    p.on_access("c")
    assert drain(p) == ["b", "d", "c", "a"]


def test_arc_prefers_recency_list_then_adapts_on_ghost_hit():
    p = ARCPolicy()
    for k in "abcd":
        p.on_insert(k)
    p.on_access("a")  # a moves to the frequency list T2
    assert p.pop_victim(ALL) == "b"  # T1 (seen once) goes first
    assert "b" in p.b1
    p.on_insert("b")  # a ghost hit in B1 grows the recency target
    assert p.p > 0 and "b" in p.t2
    assert drain(p)[0] == "c"


def test_s3fifo_one_hit_wonders_leave_first_and_ghosts_return_to_main():
    p = S3FIFOPolicy()
    for k in range(10):
        p.on_insert(k)
    for k in (0, 1, 2):
        p.on_access(k)
    order = drain(p)
    assert order[:7] == [3, 4, 5, 6, 7, 8, 9]  # never re-accessed: evicted from the small queue
    assert sorted(order[7:]) == [0, 1, 2]
    p.on_insert(3)  # 3 is in the ghost queue: it goes straight to main
    assert 3 in p.main


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_non_evictable_keys_are_never_chosen(name):
    p = make_policy(name)
    for k in range(20):
        p.on_insert(k)
    for k in range(0, 20, 3):
        p.on_access(k)
    protected = {0, 5, 7, 19}
    victims = drain(p, lambda k: k not in protected)
    assert set(victims) == set(range(20)) - protected
    assert p.pop_victim(ALL) in protected  # still there, evictable once unprotected


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_removed_keys_are_forgotten(name):
    p = make_policy(name)
    for k in range(5):
        p.on_insert(k)
    p.on_remove(2)
    assert sorted(drain(p)) == [0, 1, 3, 4]
    assert len(p) == 0


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("random")
