"""A byte-rate pacer for replay answers: however many requests arrive, replay sends at most `rate`
bytes a second (a token bucket one second deep), so a flood of 8-byte requests cannot turn into
gigabytes or hold the server loop; the replay task sleeps while the bucket refills.
"""

from __future__ import annotations

import asyncio
import time


class BytePacer:
    def __init__(self, rate: float) -> None:
        assert rate > 0
        self.rate = rate
        self._tokens = rate  # a full second's worth at start
        self._last = time.monotonic()
        self.waited = 0.0  # seconds replay slept for the budget (describe)

    async def spend(self, nbytes: int) -> None:
        """Take `nbytes` from the bucket, sleeping until it holds them (a debt larger than a second is
        paid off the same way, so one big batch is never refused, only delayed)."""
        now = time.monotonic()
        self._tokens = min(self.rate, self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= nbytes
        if self._tokens < 0:
            wait = -self._tokens / self.rate
            self.waited += wait
            await asyncio.sleep(wait)
