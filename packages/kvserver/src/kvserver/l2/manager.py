"""The tier manager: write-behind from L1 to every tier, prefetch into L1, usage, lifecycle.

Write-behind: a commit in L1 enqueues its keys (a bounded queue; when full, the keys are dropped and
counted: an engine's store is never blocked or slowed). A few writer tasks take batches off the
queue, lease the objects while the serde chain encodes them in a worker thread (so eviction cannot
recycle the bytes underneath), then put each batch to each tier in one call. An object evicted
before its turn is skipped. Eviction from L1 never touches L2 copies.

Writes a tier missed while it was down are kept (a bounded set of keys per tier) and queued again
when the tier answers again; keys that no longer fit, or whose object left L1 meanwhile, are
dropped and counted. Admission (admission.py) can hold commits back until their second use, or
(`evicted`, tiering.py) write nothing at commit and each object L2 lacks when L1 evicts it; a
negative cache (negcache.py) spares lookups a round trip for keys a tier just said it lacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvprotocol import ObjectKey

from ..l1.cache import L1Cache
from .admission import Admission
from .base import BlobParts, L2Adapter, L2Error, LazyBlob, blob_parts
from .keys import key_str
from .negcache import NegativeCache
from .prefetch import Prefetcher
from .serde import Serde
from .tier import Tier
from .tiering import MODES as TIERING_MODES
from .tiering import Tiering

log = logging.getLogger("kvserver.l2")
COPY_BYTES = 1 << 30  # at most this much of evicted objects' copies waits in the write-behind queue
Copy = tuple[bytes, int]  # an evicted object's bytes and checksum, copied before its slot was reused
QueueItem = tuple[ObjectKey, tuple[int, ...], Copy | None]  # key, indexes of the tiers to write, copy


class TierManager:
    def __init__(
        self,
        adapters: Sequence[L2Adapter],
        serde: Serde,
        l1: L1Cache,
        *,
        queue_size: int = 1024,
        prefetch_timeout: float = 0.5,
        writers: int = 2,
        batch: int = 16,
        usage_interval: float = 1.0,
        admission: str = "all",
        capacity_bytes: int | None = None,
        eviction_policy: str = "lru",
        negative_ttl: float = 1.0,
        retry_keys: int = 4096,
    ) -> None:
        if queue_size < 1:
            raise ValueError("l2 queue size must be at least 1")
        if not prefetch_timeout > 0:
            raise ValueError("l2 prefetch timeout must be positive")
        self.tiers = [Tier(a) for a in adapters]
        self.serde = serde
        self.l1 = l1
        self.queue_size = queue_size
        self.prefetch_timeout = prefetch_timeout
        self.batch = batch
        self.usage_interval = usage_interval
        self.queue_dropped = 0  # keys refused because the queue was full
        self.skipped = 0  # keys evicted from L1 before their write
        self._writers = writers
        self._queue: asyncio.Queue[QueueItem] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.tiering: Tiering | None = None
        if admission in TIERING_MODES:
            self.tiering = Tiering(l1, admission, capacity_bytes, eviction_policy, self.enqueue_copy, self.delete)
            admission = "all"  # nothing held back at commit: commits are not written at all
        self.admission = Admission(admission)
        self._deletes: set[asyncio.Task[None]] = set()
        self._copy_bytes = 0  # bytes of evicted objects' copies waiting in the queue
        self.negative = NegativeCache(negative_ttl)
        self.retry_keys = retry_keys  # per tier: keys kept to write again once a down tier answers
        if self.admission.mode != "all":
            l1.on_evict.append(self.admission.on_evict)
        # observers (KV events): keys a tier now holds, and keys a tier was found not to hold
        self.on_put: list[Callable[[int, list[ObjectKey]], None]] = []
        self.on_missing: list[Callable[[int, list[ObjectKey]], None]] = []
        self.prefetcher = Prefetcher(l1, self.tiers, serde, self.negative, self.on_missing, self.enqueue)
        if self.tiering is not None:
            self.on_missing.append(self.tiering.missing)
            self.prefetcher.on_loaded.append(self.tiering.loaded)

    @property
    def wants_hits(self) -> bool:
        """Whether lookups' L1 hits should be reported (`hit`)."""
        return self.tiering is not None or self.admission.mode != "all"

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        self._queue = asyncio.Queue(self.queue_size)
        for tier in self.tiers:
            try:
                await tier.adapter.start()
            except L2Error as exc:
                tier.failed(exc)
        self._tasks = [asyncio.create_task(self._writer(), name=f"l2-writer-{i}") for i in range(self._writers)]
        self._tasks.append(asyncio.create_task(self._usage_loop(), name="l2-usage"))

    async def presence(self, keys: Sequence[ObjectKey]) -> list[list[bool] | None]:
        """Per tier, which keys it holds: one batched `contains` each, bounded by the prefetch timeout.

        None stands for a tier that is down, failing or too slow: presence is unknown, not absent.
        """
        names = [key_str(k) for k in keys]

        async def one(tier: Tier) -> list[bool] | None:
            if not tier.available():
                return None
            try:
                present = list(await asyncio.wait_for(tier.adapter.contains(names), self.prefetch_timeout))
                tier.succeeded()
                return present
            except L2Error as exc:
                tier.failed(exc)
            except TimeoutError:
                pass
            return None

        return list(await asyncio.gather(*(one(t) for t in self.tiers)))

    async def stop(self, drain_timeout: float = 5.0) -> None:
        """Flush what is queued (bounded), then stop tasks and close adapters."""
        if self._queue is not None and self._tasks:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._queue.join(), drain_timeout)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.prefetcher.cancel_all()
        await asyncio.gather(*self._deletes, return_exceptions=True)
        for tier in self.tiers:
            await tier.adapter.close()
        self._tasks = []

    # -- write-behind ----------------------------------------------------------------------------
    def committed(self, keys: Sequence[ObjectKey]) -> None:
        """The on_commit hook: queue what admission lets through now (nothing when L1 evictions write)."""
        if self.tiering is not None:
            return
        admitted = self.admission.on_commit(keys)
        if admitted:
            self.enqueue(admitted)

    def hit(self, keys: Sequence[ObjectKey]) -> None:
        """Objects a lookup hit in L1: under `second-hit` admission, held-back ones are written now."""
        if self.tiering is not None:
            self.tiering.hit(keys)
            return
        admitted = self.admission.on_hit(keys)
        if admitted:
            self.enqueue(admitted)

    def _missed(self, index: int, keys: list[ObjectKey]) -> None:
        """Writes tier `index` missed while down: keep them for a retry, as far as the bound allows."""
        if self.tiering is not None:
            self.tiering.lost(keys)  # an evicted object's copy is gone: nothing to retry from
            self.tiers[index].stats.dropped += len(keys)
            return
        tier = self.tiers[index]
        room = max(0, self.retry_keys - len(tier.retry))
        for key in keys[:room]:
            tier.retry[key] = None
        tier.stats.dropped += max(0, len(keys) - room)

    def _flush_retry(self, index: int) -> None:
        """The tier answers again: queue the writes it missed (as many as the queue takes)."""
        tier = self.tiers[index]
        if not tier.retry or self._queue is None:
            return
        room = self.queue_size - self._queue.qsize()
        keys: list[ObjectKey] = []
        while tier.retry and len(keys) < room:
            keys.append(tier.retry.popitem(last=False)[0])
        tier.stats.retried += len(keys)
        self.enqueue(keys, (index,))

    def enqueue(self, keys: Sequence[ObjectKey], tiers: tuple[int, ...] | None = None) -> None:
        """Queue keys for L2 (the on_commit hook). Never blocks: overflow is dropped and counted."""
        if self._queue is None:
            return
        targets = tuple(range(len(self.tiers))) if tiers is None else tiers
        for i, key in enumerate(keys):
            try:
                self._queue.put_nowait((key, targets, None))
            except asyncio.QueueFull:
                lost = len(keys) - i
                self.queue_dropped += lost
                for t in targets:
                    self.tiers[t].stats.dropped += lost
                return

    def enqueue_copy(self, key: ObjectKey, data: bytes, checksum: int) -> bool:
        """Queue the write of an object L1 is evicting, from a copy of its bytes; False if dropped
        (the queue is full, or the copies queued already hold COPY_BYTES)."""
        if self._queue is None or self._copy_bytes + len(data) > COPY_BYTES:
            lost = True
        else:
            try:
                self._queue.put_nowait((key, tuple(range(len(self.tiers))), (data, checksum)))
                lost = False
            except asyncio.QueueFull:
                lost = True
        if lost:
            self.queue_dropped += 1
            for tier in self.tiers:
                tier.stats.dropped += 1
            return False
        self._copy_bytes += len(data)
        return True

    def delete(self, keys: list[ObjectKey]) -> None:
        """Delete `keys` from every tier in the background (L2's own eviction, tiering.py)."""
        if self._queue is None:
            return
        if self.tiering is not None:
            self.tiering.deleting(keys)
        task = asyncio.get_running_loop().create_task(self._delete(keys))
        self._deletes.add(task)
        task.add_done_callback(self._deletes.discard)

    def discard(self, keys: list[ObjectKey]) -> None:
        """Objects found damaged: out of the directory and deleted from every tier in the background,
        whatever the directory says (`delete` keeps what was admitted again)."""
        if self.tiering is not None:
            self.tiering.lost(keys)
        self.delete(keys)

    async def _delete(self, keys: list[ObjectKey]) -> None:
        tiering = self.tiering
        try:
            await self._delete_files(keys)
        finally:
            if tiering is not None:
                tiering.deleted(keys)

    async def _delete_files(self, keys: list[ObjectKey]) -> None:
        """Delete once no prefetch is reading them (a prefetch's own reservations can evict, through
        the demotions they cause, the L2 objects it is about to read)."""
        reading = [f for f in map(self.prefetcher.inflight.get, keys) if f is not None]
        if reading:
            await asyncio.wait(reading)
        tiering = self.tiering
        if tiering is not None:
            keys = [k for k in keys if k not in tiering.directory]  # admitted again since: keep the file
        names = [key_str(k) for k in keys]
        for index, tier in enumerate(self.tiers):
            if not names or not tier.available():
                continue
            try:
                await tier.adapter.delete(names)
            except L2Error as exc:
                tier.failed(exc)
                continue
            tier.stats.evicted += len(names)
            for hook in self.on_missing:  # KV events: the tier no longer holds them
                hook(index, keys)
        if tiering is not None:  # admitted again while the delete ran: its write may have come first
            tiering.lost([k for k in keys if k in tiering.directory])

    async def _writer(self) -> None:
        assert self._queue is not None
        while True:
            items = [await self._queue.get()]
            while len(items) < self.batch and not self._queue.empty():
                items.append(self._queue.get_nowait())
            try:
                await self._write_batch(items)
            except Exception:  # a writer must never die silently
                log.exception("L2 write-behind batch failed")
            finally:
                for _ in items:
                    self._queue.task_done()

    async def _write_batch(self, items: list[QueueItem]) -> None:
        try:
            await self._write_items(items)
        finally:
            if self.tiering is not None:
                self.tiering.done([key for key, _, copy in items if copy is not None])

    async def _write_items(self, items: list[QueueItem]) -> None:
        live: list[tuple[ObjectKey, str, memoryview | bytes, int, tuple[int, ...]]] = []
        leased: list[ObjectKey] = []
        for key, targets, copy in items:
            if copy is not None:
                self._copy_bytes -= len(copy[0])
                if self.tiering is not None and key not in self.tiering.directory:
                    self.skipped += 1  # L2 evicted it before its write: do not write it at all
                    continue
                live.append((key, key_str(key), copy[0], copy[1], targets))
                continue
            entry = self.l1.ready(key)
            if entry is None:
                self.skipped += 1
                continue
            self.l1.lease(key)
            leased.append(key)
            live.append((key, key_str(key), self.l1.arena.read(entry.offset, entry.size), entry.checksum, targets))
        if not live:
            return
        joining = any(not t.adapter.takes_parts for t in self.tiers)

        def encode() -> tuple[list[tuple[bytes, bytes | memoryview]], list[bytes]]:
            parts = [self.serde.encode_parts(k, data, cs) for _, k, data, cs, _ in live]
            return parts, [b"".join(p) for p in parts] if joining else []

        try:  # tiers that take parts write a plain body from the L1 slot: leased until they are done
            if joining:  # encoded once for both kinds of tier
                parts: Sequence[BlobParts | LazyBlob]
                parts, joined = await asyncio.to_thread(encode)
            else:  # each encoded by the tier's writer thread right before its write
                parts = [LazyBlob(functools.partial(self.serde.encode_parts, k, d, cs)) for _, k, d, cs, _ in live]
                joined = []
            await self._put_tiers(live, parts, direct=True)
        finally:
            for key in leased:
                self.l1.unlease(key)
        await self._put_tiers(live, joined, direct=False)
        if self.tiering is not None:  # evicted from L2 while being written: its delete may have come first
            late = [key for key, *_ in live if key not in self.tiering.directory]
            if late:
                self.delete(late)

    async def _put_tiers(
        self,
        live: list[tuple[ObjectKey, str, memoryview | bytes, int, tuple[int, ...]]],
        blobs: Sequence[bytes | BlobParts | LazyBlob],
        direct: bool,
    ) -> None:
        """Write the blobs to the tiers that take parts (`direct`) or to the others."""
        for index, tier in enumerate(self.tiers):
            if tier.adapter.takes_parts != direct:
                continue
            batch = [(k, blob) for (_, k, _, _, targets), blob in zip(live, blobs, strict=True) if index in targets]
            if not batch:
                continue
            written = [key for key, _, _, _, targets in live if index in targets]
            if not tier.available():
                self._missed(index, written)
                continue
            try:
                if direct:
                    await tier.adapter.put_parts([(k, b) for k, b in batch if not isinstance(b, bytes)])
                else:
                    await tier.adapter.put([(k, b) for k, b in batch if isinstance(b, bytes)])
            except L2Error as exc:
                tier.failed(exc)
                self._missed(index, written)
                continue
            tier.succeeded()
            self.negative.forget(index, (k for k, _ in batch))
            self._flush_retry(index)
            tier.stats.puts += len(batch)
            tier.stats.put_bytes += sum(_size(b) for _, b in batch)
            for hook in self.on_put:
                hook(index, written)

    # -- prefetch --------------------------------------------------------------------------------
    async def prefetch(
        self,
        chunks: Sequence[Sequence[ObjectKey]],
        first_miss: int,
        size_of: Callable[[ObjectKey], int | None],
        leading: bool = True,
        located: Callable[[int], None] | None = None,
    ) -> None:
        """Load into L1 what the tiers hold of the prefix after `first_miss` (see prefetch.py)."""
        await self.prefetcher.run(chunks, first_miss, size_of, self.prefetch_timeout, leading, located)

    # -- usage -----------------------------------------------------------------------------------
    async def _usage_loop(self) -> None:
        while True:
            started = time.monotonic()
            for tier in self.tiers:
                if not tier.available():
                    continue
                try:
                    tier.usage = await tier.adapter.usage()
                    tier.succeeded()
                    self._flush_retry(self.tiers.index(tier))
                except L2Error as exc:
                    tier.failed(exc)
                except Exception:
                    log.exception("L2 usage probe of %s failed", tier.url)
            spent = time.monotonic() - started
            await asyncio.sleep(max(self.usage_interval, 20 * spent))  # big directories: probe less

    def describe(self) -> list[dict[str, Any]]:
        return [t.describe() for t in self.tiers]

    def describe_queue(self) -> dict[str, Any]:
        p = self.prefetcher
        return {
            "queued": self._queue.qsize() if self._queue else 0,
            "capacity": self.queue_size,
            "dropped": self.queue_dropped,
            "skipped_evicted": self.skipped,
            "deletes_in_flight": len(self._deletes),
            "prefetch_lookups": p.lookups,
            "prefetched_objects": p.loaded,
            "prefetch_timeouts": p.timeouts,
            "negative_cache": len(self.negative),
            "negative_cache_hits": self.negative.hits,
            "admission": self.tiering.describe() if self.tiering is not None else self.admission.describe(),
            "compression": self.serde.compression,
            "encrypted": self.serde.encrypted,
        }


def _size(blob: bytes | BlobParts | LazyBlob) -> int:
    return len(blob) if isinstance(blob, bytes) else sum(map(len, blob_parts(blob)))
