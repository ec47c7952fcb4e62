"""The L2 directory with real policy classes (ints as keys): a bounded L2 that evicts tail first,
refuses a key that would cut its own prefix, and evicts promoted copies first."""

from __future__ import annotations

import pytest

from kvserver.l1.eviction import POLICIES, make_policy
from kvserver.l2.directory import L2Directory


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_bounded_directory_keeps_every_held_prefix_whole(policy: str) -> None:
    """Chains 1->2->3..., 100->101->..., written tail first (as L1 evicts them): whatever the policy
    evicts, every held key's held parent chain reaches a head or a key that was never written."""
    d: L2Directory[int] = L2Directory(make_policy(policy), capacity_bytes=5)
    chains = [list(range(base, base + 4)) for base in (0, 100, 200, 300)]
    for chain in chains:
        for i in reversed(range(len(chain))):
            _, victims = d.admit(chain[i], 1, chain[i - 1] if i else None)
            assert all(v not in d for v in victims)
            assert d.bytes <= 5
    for chain in chains:
        held = [k in d for k in chain]
        assert held == sorted(held, reverse=True), (policy, chain, held)  # a prefix, never a hole


def test_admission_refuses_rather_than_evicting_its_own_prefix() -> None:
    d: L2Directory[int] = L2Directory(make_policy("lru"), capacity_bytes=2)
    assert d.admit(2, 1, 1) == (True, [])
    assert d.admit(1, 1, None) == (True, [])
    assert d.admit(3, 1, 2) == (False, [])  # only 1 and 2 could go, and they are 3's prefix
    assert (1 in d, 2 in d, 3 in d, d.refused) == (True, True, False, 1)


def test_promoted_keys_go_first_and_settle_back_for_free() -> None:
    d: L2Directory[int] = L2Directory(make_policy("lru"), capacity_bytes=2)
    d.admit(10, 1)
    d.admit(20, 1)
    d.promote([20])  # loaded into L1: L2's copy is the first to go
    assert d.admit(30, 1) == (True, [20])
    d.promote([10])
    assert d.settle(10) is True  # L1 evicts it while L2 holds it: nothing to write, back in the policy
    assert d.settle(20) is False  # gone from L2: L1's eviction must write it
    assert d.admit(40, 1) == (True, [30])  # 10 settled after 30 was written: 30 is older
