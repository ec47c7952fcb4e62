"""Work a request causes that its reply does not depend on, run once the reply is on its way.

Why: a 4096-token lookup's recency updates (the eviction policy's touches of 16 keys, 13-33 us,
and the L2 admission hook) and every request's latency observers change nothing the reply says, yet
they sat between the request and its answer. The server queues them here and runs them right after
the reply is handed to ZMQ, and always before it reads the next request, so every request still
sees the effects of all the requests before it, exactly as if they had run inline.

Code that calls the cache without a server (tests, tools) keeps the inline behaviour: `run_now`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("kvserver")

Work = Callable[[], None]
Defer = Callable[[Work], None]


def run_now(work: Work) -> None:
    """The default `Defer`: no reply to wait for, so the work runs at once."""
    work()


class AfterReply:
    """A FIFO of deferred work; `run()` drains it (work queued while draining runs too)."""

    def __init__(self) -> None:
        self._work: list[Work] = []

    def defer(self, work: Work) -> None:
        self._work.append(work)

    def __len__(self) -> int:
        return len(self._work)

    def run(self) -> None:
        """Run everything queued, in order. A failing item is logged and the rest still run: the
        request it belonged to has been answered, and the loop must go on serving."""
        while self._work:
            work, self._work = self._work, []
            for item in work:
                try:
                    item()
                except Exception:
                    log.exception("deferred work of an answered request failed")
