"""Back off from a server that fails: one timeout, then skip it for a while (doubling, capped).

Why: every vLLM step may call the server (lookups, loads, saves). With the server gone, each call
would wait its full timeout and stall the engine; with the breaker open, the connector answers
"miss"/"not stored" at once and the engine simply recomputes, then it tries the server again.
"""

from __future__ import annotations

import time

MAX_BACKOFF_S = 30.0


class Breaker:
    def __init__(self, retry_after_s: float) -> None:
        self._base = retry_after_s
        self._backoff = retry_after_s
        self._open_until = 0.0
        self.failures = 0

    def allow(self) -> bool:
        return time.monotonic() >= self._open_until

    def failed(self) -> None:
        self.failures += 1
        self._open_until = time.monotonic() + self._backoff
        self._backoff = min(MAX_BACKOFF_S, max(self._backoff * 2, 0.001))

    def succeeded(self) -> None:
        self._backoff = self._base
        self._open_until = 0.0
