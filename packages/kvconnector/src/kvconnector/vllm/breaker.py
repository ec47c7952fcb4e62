"""Back off from a server that fails: one timeout, then skip it for a while (doubling, capped).

Why: every vLLM step may call the server (lookups, loads, saves). With the server gone, each call
would wait its full timeout and stall the engine; with the breaker open, the connector answers
"miss"/"not stored" at once and the engine simply recomputes, then it tries the server again.
The policy is kvprotocol's one Backoff.
"""

from __future__ import annotations

from kvprotocol import Backoff

MAX_BACKOFF_S = 30.0


class Breaker(Backoff):
    def __init__(self, retry_after_s: float) -> None:
        super().__init__(retry_after_s, MAX_BACKOFF_S)
