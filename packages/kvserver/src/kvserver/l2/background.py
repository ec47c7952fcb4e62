"""L2 prefetches that a lookup with `wait: false` started and did not wait for.

Why: an engine's scheduler must never block on L2. Such a lookup answers at once with the L1 hit and
`pending: true` while a prefetch of the missing prefix runs here; the engine asks again later. When
the prefetch has ended, the next such lookup of the same range answers `pending: false` with what
L1 then holds (and consumes the record, so a later lookup may prefetch again).
A range is identified by the chained hashes of its first missing chunk and of its last chunk.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Hashable
from typing import Any

log = logging.getLogger("kvserver.l2")
KEEP_S = 60.0  # an unclaimed "done" record is forgotten after this long
MAX_RECORDS = 4096


class BackgroundPrefetches:
    def __init__(self) -> None:
        self.running: dict[Hashable, asyncio.Task[None]] = {}
        self.done: OrderedDict[Hashable, float] = OrderedDict()
        self.started = 0

    def poll(self, key: Hashable, start: Callable[[], Coroutine[Any, Any, None]]) -> bool:
        """True while a prefetch of `key` runs (starting one if none ran lately); False once it ended."""
        if key in self.running:
            return True
        self._expire()
        if self.done.pop(key, None) is not None:
            return False
        if len(self.running) >= MAX_RECORDS:
            return False  # too many in flight: answer from L1 alone
        task = asyncio.get_running_loop().create_task(start())
        self.running[key] = task
        self.started += 1
        task.add_done_callback(functools.partial(self._finished, key))
        return True

    def _finished(self, key: Hashable, task: asyncio.Task[None]) -> None:
        self.running.pop(key, None)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background L2 prefetch failed: %r", task.exception())
        self.done[key] = time.monotonic()
        while len(self.done) > MAX_RECORDS:
            self.done.popitem(last=False)

    def _expire(self) -> None:
        now = time.monotonic()
        while self.done:
            if now - next(iter(self.done.values())) < KEEP_S:
                break
            self.done.popitem(last=False)
