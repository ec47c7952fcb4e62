"""The scheduler's wait for a lookup's answer follows the engine's busy steps (lookup_wait.py)."""

from __future__ import annotations

import pytest

from kvconnector.vllm.lookup_wait import LookupWait


def test_the_floor_until_a_busy_step_was_timed() -> None:
    w = LookupWait(floor_s=0.002, share=0.1, cap_s=0.02)
    assert w.seconds() == 0.002
    w.step(10.0, busy=True)  # a first step: no period yet
    assert w.seconds() == 0.002


def test_a_share_of_the_busy_steps_period_between_floor_and_cap() -> None:
    w = LookupWait(floor_s=0.002, share=0.1, cap_s=0.02)
    for i in range(20):  # steps of 100 ms
        w.step(10.0 + 0.1 * i, busy=True)
    assert w.seconds() == pytest.approx(0.01)
    fast = LookupWait(floor_s=0.002, share=0.1, cap_s=0.02)
    for i in range(20):  # steps of 5 ms: a tenth is below the floor
        fast.step(10.0 + 0.005 * i, busy=True)
    assert fast.seconds() == 0.002
    slow = LookupWait(floor_s=0.002, share=0.1, cap_s=0.02)
    for i in range(20):  # steps of 1 s: capped
        slow.step(10.0 + i, busy=True)
    assert slow.seconds() == 0.02


def test_the_gap_after_an_idle_step_is_not_a_steps_length() -> None:
    w = LookupWait(floor_s=0.002, share=0.1, cap_s=0.5)
    w.step(0.0, busy=True)
    w.step(0.1, busy=False)  # the busy step took 100 ms; then nothing to compute
    w.step(60.0, busy=True)  # the engine slept a minute waiting for requests
    assert w.seconds() == pytest.approx(0.01)


def test_share_zero_keeps_the_fixed_wait() -> None:
    w = LookupWait(floor_s=0.002, share=0.0, cap_s=0.02)
    for i in range(5):
        w.step(float(i), busy=True)
    assert w.seconds() == 0.002


def test_an_idle_engine_waits_longer_whatever_its_steps() -> None:
    w = LookupWait(floor_s=0.002, share=0.1, cap_s=0.02, idle_s=0.1)
    assert w.seconds(idle=True) == 0.1  # before any step was timed
    for i in range(20):  # steps of 100 ms
        w.step(10.0 + 0.1 * i, busy=True)
    assert w.seconds() == pytest.approx(0.01) and w.seconds(idle=True) == 0.1
    assert LookupWait(floor_s=0.002, share=0.1, cap_s=0.02).seconds(idle=True) == 0.002  # idle_s 0: the floor
