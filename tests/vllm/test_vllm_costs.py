"""The load planner's arithmetic (costs.py): optimistic until both rates are measured, then load only
when loading is estimated no slower than recomputing; a load's cost is a fixed part per load and a
part per token."""

from __future__ import annotations

from kvconnector.vllm.costs import MIN_PREFILL_TOKENS, PROBE_EVERY, CostModel


def observe(m: CostModel, load_tokens: int, load_s: float, prefill_tokens: int = 0, prefill_s: float = 0.0) -> None:
    """One step with one load (not in the step) and a prefill."""
    m.observe_loads(1, load_tokens, load_s, in_step=False)
    m.observe_prefill(prefill_tokens, prefill_s)


def test_loads_until_both_rates_are_known() -> None:
    m = CostModel.new()
    assert m.worth_loading(512)
    observe(m, 512, 10.0)  # a very slow load, but no prefill rate yet
    assert m.worth_loading(512)


def test_declines_when_recompute_is_cheaper_and_follows_new_samples() -> None:
    m = CostModel.new()
    observe(m, 512, 1.0, 200, 0.02)  # load 2 ms/token, prefill 0.1 ms/token
    assert not m.worth_loading(512)
    for _ in range(20):  # loads got fast (1 us/token): the smoothed rate follows
        observe(m, 512, 0.000512)
    assert m.worth_loading(512)


def test_decode_steps_are_not_prefill_samples() -> None:
    m = CostModel.new()
    observe(m, 512, 1.0, MIN_PREFILL_TOKENS - 1, 100.0)
    assert m.prefill.s_per_token is None and m.worth_loading(512)


def test_a_declined_streak_ends_in_a_probe_that_measures_again() -> None:
    m = CostModel.new()
    observe(m, 512, 1.0, 200, 0.02)  # loading looks 20x slower than recomputing
    decisions = [m.worth_loading(512) for _ in range(PROBE_EVERY + 1)]
    assert decisions == [False] * PROBE_EVERY + [True]  # the probe
    assert not m.worth_loading(512)  # a new streak starts
    observe(m, 512, 0.0001)  # the probe found loads fast now: one sample is not yet enough
    assert not m.cheaper_to_load(512)
    for _ in range(20):
        observe(m, 512, 0.0001)
    assert m.worth_loading(512) and m.declined_in_a_row == 0


def test_the_fixed_part_is_paid_once_per_load_not_per_token() -> None:
    """Calibrated at 2 ms of round trips and 1 us/token of copy on one 64-token chunk: a 1,024-token
    load is ~3 ms. A rate per token alone would say (2 ms + 64 us) / 64 tokens = 32 us/token, 33 ms."""
    m = CostModel.new()
    m.calibrated(0.002)
    m.observe_loads(1, 64, 0.002 + 64e-6, in_step=True)
    m.observe_loads(1, 64, 0.002 + 64e-6, in_step=False)
    estimate = m.in_step.estimate(1024)
    assert estimate is not None and abs(estimate - 0.003024) < 1e-9
    assert m.fits_in_step(1024, 0.05, 0.25)  # 3 ms <= 12.5 ms
    m.observe_prefill(1000, 0.010)  # prefill 10 us/token: 1,024 tokens in 10 ms, a load in 3 ms
    assert m.cheaper_to_load(1024)
    assert not m.cheaper_to_load(64)  # 2.06 ms to load against 0.64 ms to recompute: the round trips dominate


def test_one_load_faster_than_the_fixed_part_lowers_it() -> None:
    """No load is faster than its round trips: a calibration that met a busy host is corrected by
    the first sample that says so, not after many."""
    m = CostModel.new()
    m.calibrated(0.010)  # the calibration met a busy server
    m.observe_loads(2, 128, 0.002, in_step=True)  # two loads of one ms each
    assert m.in_step.fixed_s == 0.001
    assert m.fits_in_step(64, 0.02, 0.25)  # ~1 ms <= 5 ms
    m.observe_loads(1, 64, 0.0015, in_step=True)  # slower than the fixed part: the rest is per token
    assert m.in_step.fixed_s == 0.001


def test_a_load_fits_in_the_step_only_when_its_estimate_is_within_the_share() -> None:
    m = CostModel.new()
    assert not m.fits_in_step(512, 0.1, 0.25)  # no load rate yet: the background
    observe(m, 512, 0.005)  # a background load: says nothing of a copy in the step
    assert not m.fits_in_step(512, 0.1, 0.25)
    m.observe_loads(1, 512, 0.005, in_step=True)  # ~10 us/token in the step: 512 tokens in 5 ms
    assert not m.fits_in_step(512, None, 0.25)  # no step period yet
    assert m.fits_in_step(512, 0.1, 0.25)  # 5 ms <= 25 ms
    assert not m.fits_in_step(512, 0.01, 0.25)  # 5 ms > 2.5 ms
    assert not m.fits_in_step(4096, 0.1, 0.25)  # 40 ms > 25 ms
    assert not m.fits_in_step(512, 0.1, 0.0)  # share 0: every load in the background


def test_slow_background_loads_do_not_keep_loads_out_of_the_step() -> None:
    """A background copy on a busy host is timed with its waits for the CPU: those times teach the
    planner, never where a load goes, or once some loads went to the background all would."""
    m = CostModel.new()
    m.observe_loads(1, 512, 0.005, in_step=True)  # the calibration: 10 us/token
    for _ in range(20):
        observe(m, 512, 0.5)  # background loads at 1 ms/token
    assert m.fits_in_step(512, 0.1, 0.25)
    m.observe_loads(1, 512, 0.5, in_step=True)  # a copy in the step that really is slow
    m.observe_loads(1, 512, 0.5, in_step=True)
    assert not m.fits_in_step(512, 0.1, 0.25)
