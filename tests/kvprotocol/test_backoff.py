"""The one backoff policy shared by the connector's breaker, its server link and the L2 tiers."""

from __future__ import annotations

import time

from kvprotocol import Backoff


def test_delays_double_up_to_the_cap_and_reset_on_success():
    b = Backoff(0.25, 1.0)
    assert b.allow() and b.up and b.remaining() == 0.0
    assert [b.failed() for _ in range(4)] == [0.25, 0.5, 1.0, 1.0]
    assert not b.allow() and not b.up and 0.0 < b.remaining() <= 1.0
    assert b.failures == 4
    b.succeeded()
    assert b.allow() and b.up
    assert b.failed() == 0.25  # back to the base delay after a success


def test_a_peer_may_be_tried_again_once_the_delay_ran_out():
    b = Backoff(0.05, 0.05)
    b.failed()
    assert not b.allow()
    time.sleep(0.06)
    assert b.allow() and not b.up  # tried again, but not known healthy until a success


def test_zero_base_never_blocks():
    b = Backoff(0.0)
    b.failed()
    assert b.allow()
