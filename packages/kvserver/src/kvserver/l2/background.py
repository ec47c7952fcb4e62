"""L2 prefetches that a lookup with `wait: false` started and did not wait for.

Why: an engine's scheduler must never block on L2. Such a lookup answers at once with the L1 hit and
`pending: true` while a prefetch of the missing prefix runs here; the engine asks again later. When
the prefetch has ended, the next such lookup of the same range answers `pending: false` with what
L1 then holds (and consumes the record, so a later lookup may prefetch again).
A range is identified by the chained hash of its last chunk (it names the whole prefix): a lookup
whose hit grew while the prefetch ran (a streamed load polls as chunks land) finds the same record,
and starts no second prefetch.

A prefetch also says how far it will reach once it has located its objects (`located`): a lookup
with `expect` waits for that (bounded), so the engine can report the whole hit at once and load its
chunks as they land (a streamed load, docs/l2.md).
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
        self.reach: dict[Hashable, asyncio.Future[int]] = {}  # a running prefetch's located end (chunks)
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

    def located(self, key: Hashable, end: int) -> None:
        """The prefetch of `key` located its objects: L1 + L2 cover its first `end` chunks."""
        if key in self.running:
            future = self._reach(key)
            if not future.done():
                future.set_result(end)

    async def expected(self, key: Hashable, timeout: float) -> int | None:
        """The located end of the running prefetch of `key` (waiting at most `timeout` for it);
        None when none runs, or it ended or timed out before locating."""
        task = self.running.get(key)
        if task is None:
            return None
        future = self._reach(key)
        if not future.done():
            await asyncio.wait((future, task), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        return future.result() if future.done() and not future.cancelled() else None

    async def progress(self, key: Hashable, loads: list[asyncio.Future[bool]], timeout: float) -> None:
        """Wait until one of `loads` ended or the prefetch of `key` did (at most `timeout`)."""
        task = self.running.get(key)
        if task is not None and loads:
            waits: list[asyncio.Future[Any]] = [*loads, task]
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)

    def _reach(self, key: Hashable) -> asyncio.Future[int]:
        future = self.reach.get(key)
        if future is None:
            future = self.reach[key] = asyncio.get_running_loop().create_future()
        return future

    def _finished(self, key: Hashable, task: asyncio.Task[None]) -> None:
        self.running.pop(key, None)
        future = self.reach.pop(key, None)
        if future is not None and not future.done():
            future.cancel()
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
