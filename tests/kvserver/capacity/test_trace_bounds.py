"""The calibrated bounds (kvserver.tracebounds): conversations recovered from block prefixes, and
lhd with whole-trace statistics replaying a trace, below Belady's optimum."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvprotocol import ObjectKey
from kvserver.l1.eviction.density import HitDensity
from kvtestkit.tracebounds import calibrated, conversations, trace_classes
from kvtestkit.tracesim import Request, belady, load_trace, unique_blocks

SHARED = Path(__file__).resolve().parents[3].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def req(*blocks: int) -> Request:
    return Request(blocks, 512 * len(blocks))


def test_a_request_continues_the_latest_one_sharing_two_blocks_or_more():
    trace = [req(0, 1, 2), req(0, 1, 2, 3), req(0, 5), req(0, 1, 2, 3, 4), req(0, 5, 6), req(7, 8)]
    turn, root = conversations(trace)
    assert turn == [1, 2, 1, 3, 2, 1]
    assert root == [0, 0, 2, 0, 2, 5]


def test_trace_classes_follow_turn_and_length_and_set_shared_blocks_apart():
    trace = [req(0, 1, 2), req(0, 1, 2, 3), req(0, 5)]
    n, classify, before = trace_classes(trace)
    key = lambda b: ObjectKey("trace", "0" * 16, 1, 0, 0, "", b.to_bytes(32, "big"))  # noqa: E731
    for i, r in enumerate(trace):
        before(i, r)
    assert classify(key(0), 1, 1) == n - 1  # block 0 is in two conversations
    assert classify(key(3), 1, 1) == classify(key(1), 1, 1) != classify(key(5), 1, 1)  # turn 2 vs turn 1


def test_a_frozen_estimator_keeps_its_densities():
    est = HitDensity(2, ages=8)
    for _ in range(100):
        est.reuse(0, 1)
    frozen = est.frozen_copy()
    before = [list(row) for row in frozen.density]
    frozen.reuse(1, 1)
    assert frozen.refresh() == 0 and frozen.density == before and not frozen.coarsen()


@pytest.mark.skipif(not SHARED.exists(), reason="needs the Mooncake trace in ../shared/traces")
@pytest.mark.parametrize("features", ["lineage", "trace"])
def test_calibrated_replays_stay_below_the_optimum(features):
    trace = load_trace(SHARED, limit=1500)
    cap = round(unique_blocks(trace) * 0.05)
    rates = calibrated(trace, cap, features, passes=1)
    assert len(rates) == 2 and min(rates) > 0
    assert max(rates) <= belady(trace, cap) + 1e-12


def test_unknown_features_are_refused():
    with pytest.raises(ValueError, match="features"):
        calibrated([req(0)], 1, "oracle")
