"""The two-tier trace simulation (kvtestkit.tiersim) on the first requests of the Mooncake trace
(a synthetic one where the trace is absent): properties any correct L1 + L2 must have, not figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtestkit.tiersim import two_tier
from kvtestkit.tracesim import belady, simulate, unique_blocks
from test_trace_sim import first_requests

EPS = 1e-12


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory):
    return first_requests(tmp_path_factory.mktemp("tiersim"), 600)


@pytest.mark.parametrize("l1_policy", ["lhd", "lru"])
def test_two_tiers_never_beat_belady_at_their_sum(trace, l1_policy: str) -> None:
    unique = unique_blocks(trace)
    for a, b in [(0.02, 0.05), (0.05, 0.1), (0.05, 0.3)]:
        ca, cb = max(1, round(a * unique)), round(b * unique)
        both = two_tier(trace, l1_policy, ca, cb)
        assert both.hit_rate <= belady(trace, ca + cb) + EPS
        assert both.l1_hit_rate <= both.hit_rate


def test_hit_rate_grows_with_l2_and_no_l2_is_l1_alone(trace) -> None:
    unique = unique_blocks(trace)
    ca = round(0.05 * unique)
    assert two_tier(trace, "lhd", ca, 0).hit_rate == simulate(trace, "lhd", ca)
    rates = [two_tier(trace, "lhd", ca, round(f * unique)).hit_rate for f in (0.05, 0.1, 0.2, 0.5, 1.0)]
    assert rates == sorted(rates) and rates[0] > simulate(trace, "lhd", ca)


def test_exclusive_lru_tiers_are_one_lru_cache(trace) -> None:
    """LRU in both tiers, written on eviction and promoted on a hit: exactly one LRU of the sum."""
    unique = unique_blocks(trace)
    for a, b in [(0.03, 0.07), (0.05, 0.2)]:
        ca, cb = round(a * unique), round(b * unique)
        assert two_tier(trace, "lru", ca, cb, l2_policy="lru").hit_rate == simulate(trace, "lru", ca + cb)


def test_objects_l2_holds_are_dropped_without_a_write(trace) -> None:
    unique = unique_blocks(trace)
    r = two_tier(trace, "lhd", round(0.05 * unique), unique)  # L2 holds everything: nothing is evicted
    assert r.l2_evictions == 0 and r.free_drops > 0
    assert r.l2_writes <= unique  # each object written at most once
    hit = two_tier(trace, "lhd", round(0.05 * unique), unique, demotion="hit")
    assert hit.l2_writes < r.l2_writes and hit.hit_rate <= r.hit_rate


def test_unknown_demotion_rule_is_refused(trace: list, tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        two_tier(trace[:5], "lru", 10, 10, demotion="sometimes")
