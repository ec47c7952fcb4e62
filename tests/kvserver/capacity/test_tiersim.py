"""The two-tier trace simulation (kvtestkit.tiersim) on the first requests of the Mooncake trace
(a synthetic one where the trace is absent): properties any correct L1 + L2 must have, not figures."""

from __future__ import annotations

from pathlib import Path

import time

import pytest

from kvprotocol import Client
from kvtestkit.tracereplay import register_trace, replay_request
from kvtestkit.tiersim import two_tier
from kvtestkit.tracesim import BLOCK_TOKENS, OBJECT_BYTES, belady, simulate, unique_blocks
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


@pytest.mark.parametrize(("l1_policy", "l2_policy"), [("lhd", "lru"), ("lhd", "lhd")])
def test_a_real_server_with_an_fs_l2_gets_the_simulated_hit_rate(
    server_factory, tmp_path: Path, l1_policy: str, l2_policy: str
) -> None:
    """A real kvserver (fs L2, `evicted` admission, L2 bounded by `--l2-capacity-gb`) replaying the
    trace, waiting before each request until the L2 writes of the one before are done (the
    simulation writes at once), gets exactly the simulated two-tier hit rate."""
    trace = first_requests(tmp_path, 300)
    unique = unique_blocks(trace)
    c1, c2 = round(0.05 * unique), round(0.5 * unique)
    srv = server_factory(
        "--l1-size-gb", repr(c1 * OBJECT_BYTES / (1 << 30)), "--chunk-size", str(BLOCK_TOKENS),
        "--eviction-policy", l1_policy, "--l2", f"fs://{tmp_path / 'l2'}", "--l2-admission", "evicted",
        "--l2-capacity-gb", repr(c2 * OBJECT_BYTES / (1 << 30)), "--l2-eviction-policy", l2_policy,
    )  # fmt: skip

    def writes_done(c: Client) -> bool:
        d = c.call("describe").result
        q = d["l2_queue"]
        written = d["l2"][0]["puts"] + q["skipped_evicted"]
        return bool(written >= q["admission"]["demoted"] and not q["deletes_in_flight"])

    with srv.client() as c:
        ks = register_trace(c)
        hit_tokens = total = 0
        for req in trace:
            deadline = time.monotonic() + 30  # a bound on a hang, not a timing check
            while not writes_done(c):
                assert time.monotonic() < deadline, "L2 writes did not finish"
                time.sleep(0.001)
            total += req.input_tokens
            hit_tokens += replay_request(c, ks, req.blocks) * BLOCK_TOKENS
        tiering = c.call("describe").result["l2_queue"]["admission"]
    sim = two_tier(trace, l1_policy, c1, c2, l2_policy=l2_policy)
    assert hit_tokens / total == pytest.approx(sim.hit_rate, abs=1e-12)
    assert sim.hit_rate > sim.l1_hit_rate  # L2 served some of it
    assert tiering["free_drops"] == sim.free_drops and tiering["evicted"] == sim.l2_evictions
