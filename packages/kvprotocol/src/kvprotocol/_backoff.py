"""Skip a failing peer for a while after each failure: base delay, doubling, capped; reset on success.

Why: a dead server or L2 store must cost one timeout, not one per request. The connector's breaker,
its server link and the server's L2 tiers all back off this one way.
"""

from __future__ import annotations

import time


class Backoff:
    def __init__(self, base_s: float, max_s: float = 30.0) -> None:
        self.base_s = base_s
        self.max_s = max(max_s, base_s)
        self.failures = 0  # failures seen since creation (a counter for stats)
        self._delay = 0.0
        self._until = 0.0

    def allow(self) -> bool:
        """True when the peer may be tried (never failed, succeeded since, or the delay ran out)."""
        return time.monotonic() >= self._until

    def remaining(self) -> float:
        """Seconds until the peer may be tried again (0 when it may be tried now)."""
        return max(0.0, self._until - time.monotonic())

    @property
    def up(self) -> bool:
        """False from a failure until the next success."""
        return self._delay == 0.0

    def failed(self) -> float:
        """Record a failure; returns the delay before the next try."""
        self.failures += 1
        self._delay = min(self.max_s, max(self.base_s, self._delay * 2))
        self._until = time.monotonic() + self._delay
        return self._delay

    def succeeded(self) -> None:
        self._delay = 0.0
        self._until = 0.0
