"""The load planner's arithmetic (costs.py): optimistic until both rates are measured, then load only
when loading is estimated no slower than recomputing."""

from __future__ import annotations

from kvconnector.vllm.costs import MIN_PREFILL_TOKENS, PROBE_EVERY, CostModel


def test_loads_until_both_rates_are_known() -> None:
    m = CostModel.new()
    assert m.worth_loading(512)
    m.observe(512, 10.0, 0, 0.0)  # a very slow load, but no prefill rate yet
    assert m.worth_loading(512)


def test_declines_when_recompute_is_cheaper_and_follows_new_samples() -> None:
    m = CostModel.new()
    m.observe(512, 1.0, 200, 0.02)  # load 2 ms/token, prefill 0.1 ms/token
    assert not m.worth_loading(512)
    for _ in range(20):  # loads got fast (1 us/token): the smoothed rate follows
        m.observe(512, 0.000512, 0, 0.0)
    assert m.worth_loading(512)


def test_decode_steps_are_not_prefill_samples() -> None:
    m = CostModel.new()
    m.observe(512, 1.0, MIN_PREFILL_TOKENS - 1, 100.0)
    assert m.prefill.s_per_token is None and m.worth_loading(512)


def test_a_declined_streak_ends_in_a_probe_that_measures_again() -> None:
    m = CostModel.new()
    m.observe(512, 1.0, 200, 0.02)  # loading looks 20x slower than recomputing
    decisions = [m.worth_loading(512) for _ in range(PROBE_EVERY + 1)]
    assert decisions == [False] * PROBE_EVERY + [True]  # the probe
    assert not m.worth_loading(512)  # a new streak starts
    m.observe(512, 0.0001, 0, 0.0)  # the probe found loads fast now: one sample is not yet enough
    assert not m.cheaper_to_load(512)
    for _ in range(20):
        m.observe(512, 0.0001, 0, 0.0)
    assert m.worth_loading(512) and m.declined_in_a_row == 0


def test_a_load_fits_in_the_step_only_when_its_estimate_is_within_the_share() -> None:
    m = CostModel.new()
    assert not m.fits_in_step(512, 0.1, 0.25)  # no load rate yet: the background
    m.observe(512, 0.005, 0, 0.0)  # a background load: says nothing of a copy in the step
    assert not m.fits_in_step(512, 0.1, 0.25)
    m.observe(512, 0.005, 0, 0.0, 512, 0.005)  # ~10 us/token in the step: 512 tokens in 5 ms
    assert not m.fits_in_step(512, None, 0.25)  # no step period yet
    assert m.fits_in_step(512, 0.1, 0.25)  # 5 ms <= 25 ms
    assert not m.fits_in_step(512, 0.01, 0.25)  # 5 ms > 2.5 ms
    assert not m.fits_in_step(4096, 0.1, 0.25)  # 40 ms > 25 ms
    assert not m.fits_in_step(512, 0.1, 0.0)  # share 0: every load in the background


def test_slow_background_loads_do_not_keep_loads_out_of_the_step() -> None:
    """A background copy on a busy host is timed with its waits for the CPU: those times teach the
    planner, never where a load goes, or once some loads went to the background all would."""
    m = CostModel.new()
    m.observe(512, 0.005, 0, 0.0, 512, 0.005)  # the calibration: 10 us/token
    for _ in range(20):
        m.observe(512, 0.5, 0, 0.0)  # background loads at 1 ms/token
    assert m.fits_in_step(512, 0.1, 0.25)
    m.observe(512, 0.5, 0, 0.0, 512, 0.5)  # a copy in the step that really is slow
    m.observe(512, 0.5, 0, 0.0, 512, 0.5)
    assert not m.fits_in_step(512, 0.1, 0.25)
