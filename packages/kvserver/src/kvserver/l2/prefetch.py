"""Prefetch: on an L1 miss, load what the L2 tiers hold of the missing prefix into L1 slots.

One batched `contains` per tier finds where the missing objects are; only the leading run of chunks
that L1 and L2 together cover is worth loading (a hole ends the prefix). The L1 objects of that run
are leased meanwhile so the new reservations cannot evict them; each loaded object gets a WRITING
slot (invisible, not evictable), is decoded and checked in a worker thread, then made READY in one
step. The caller waits at most the prefetch timeout and then answers with what is in L1; loads still
running finish (or abort their slots) in the background. Everything runs on the server's loop, so
state is re-checked after every await. A second lookup for objects already being loaded waits on the
same loads instead of fetching them again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvprotocol import ObjectKey

from ..l1.cache import Entry, L1Cache, State
from .base import L2Error, Landed
from .keys import key_str
from .serde import HEADER_BYTES, CorruptObject, Serde, UndecryptableObject

if TYPE_CHECKING:
    from .negcache import NegativeCache
    from .tier import Tier

log = logging.getLogger("kvserver.l2")
Item = tuple[ObjectKey, Entry | None, "asyncio.Future[bool]"]  # key, reserved slot (None: size unknown), done
FETCH_BATCH = 8  # objects per get: a timeout still lets earlier batches land


@dataclass(frozen=True, slots=True)
class _Loaded:
    """A decoded object: its payload (None when already written into its reserved slot) and kvsum64."""

    payload: bytes | memoryview | None
    checksum: int


def _blob_len(blob: bytes | Landed | None, entry: Entry | None) -> int:
    if isinstance(blob, Landed):
        return len(blob.head) + (entry.size if entry is not None else 0)
    return 0 if blob is None else len(blob)


class Prefetcher:
    def __init__(
        self,
        l1: L1Cache,
        tiers: Sequence[Tier],
        serde: Serde,
        negative: NegativeCache,
        on_missing: list[Callable[[int, list[ObjectKey]], None]],
        enqueue: Callable[[Sequence[ObjectKey], tuple[int, ...]], Any],
    ) -> None:
        """`on_missing` is the manager's observer list (shared, so hooks added later are seen);
        `enqueue` queues writes of loaded keys to the upper tiers."""
        self.l1, self.tiers, self.serde, self.negative = l1, tiers, serde, negative
        self.on_missing, self.enqueue = on_missing, enqueue
        self.inflight: dict[ObjectKey, asyncio.Future[bool]] = {}
        self.on_loaded: list[Callable[[list[ObjectKey]], None]] = []  # objects loaded into L1 (tiering.py)
        self.waiting: dict[ObjectKey, int] = {}  # runs waiting on a load: each gets a lease when it lands
        self.background: set[asyncio.Task[None]] = set()
        self.lookups = self.loaded = self.timeouts = 0

    async def run(
        self,
        chunks: Sequence[Sequence[ObjectKey]],
        first_miss: int,
        size_of: Callable[[ObjectKey], int | None],
        timeout: float,
        leading: bool = True,
        located: Callable[[int], None] | None = None,
    ) -> None:
        """`leading=False`: load every chunk L1 + L2 cover, not only the leading run (per-group
        geometry: a window snapshot or a state is useful on its own, see kvserver/service/groups.py).
        `located(end)`: called once the tiers have answered, with the end (in chunks) of the leading
        run L1 + L2 (+ loads in flight) cover, before any load starts (a streamed load's target)."""
        self.lookups += 1
        deadline = time.monotonic() + timeout
        l1 = self.l1
        absent = [k for ch in chunks[first_miss:] for k in ch if k not in l1.entries]
        where = await self._locate(absent, deadline)
        # after the await: take the leading run of chunks that L1 + L2 (+ loads in flight) cover
        to_load: list[ObjectKey] = []
        waits: dict[ObjectKey, asyncio.Future[bool]] = {}
        end = first_miss
        for ch in chunks[first_miss:]:
            plan, ok = [], True
            for key in ch:
                entry = l1.entries.get(key)
                if entry is None and key in where:
                    plan.append(key)
                elif entry is not None and entry.state is State.WRITING and key in self.inflight:
                    waits[key] = self.inflight[key]
                elif entry is None or entry.state is not State.READY:
                    ok = False
                    break
            if not ok:
                if leading:
                    break
                continue
            to_load.extend(plan)
            end += 1
        if located is not None:
            located(end)
        if not to_load and not waits:
            return
        protected = [k for ch in (chunks[:end] if leading else chunks) for k in ch if l1.ready(k) is not None]
        for key in protected:
            l1.lease(key)
        mine = {**waits, **self._start_loads(to_load, where, size_of)}
        for key in mine:
            self.waiting[key] = self.waiting.get(key, 0) + 1
        try:
            if mine:
                _, late = await asyncio.wait(mine.values(), timeout=max(0.0, deadline - time.monotonic()))
                if late:
                    self.timeouts += 1
        finally:
            for key in protected:
                l1.unlease(key)
            for key, future in mine.items():
                left = self.waiting.pop(key) - 1
                if left:
                    self.waiting[key] = left
                if future.done() and future.result():
                    l1.unlease(key)  # the lease _commit took for this run while it waited

    async def _locate(self, keys: list[ObjectKey], deadline: float) -> dict[ObjectKey, int]:
        """Tier index of each key some tier holds: one batched contains per tier, in tier order."""
        where: dict[ObjectKey, int] = {}
        todo = keys
        for index, tier in enumerate(self.tiers):
            if not todo:
                break
            if not tier.available():
                continue
            names = [key_str(k) for k in todo]
            known_absent = [self.negative.absent(index, n) for n in names]  # no round trip for these
            ask = [n for n, gone in zip(names, known_absent, strict=True) if not gone]
            try:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                answers = iter(await asyncio.wait_for(tier.adapter.contains(ask), remaining) if ask else [])
                present = [False if gone else next(answers) for gone in known_absent]
            except TimeoutError:
                self.timeouts += 1
                break
            except L2Error as exc:
                tier.failed(exc)
                continue
            tier.succeeded()
            self.negative.remember(
                index, (n for n, hit, gone in zip(names, present, known_absent, strict=True) if not hit and not gone)
            )
            tier.stats.misses += present.count(False)
            rest = []
            for key, hit in zip(todo, present, strict=True):
                if hit:
                    where[key] = index
                else:
                    rest.append(key)
            for hook in self.on_missing:
                hook(index, rest)
            todo = rest
        return where

    def _start_loads(
        self, keys: list[ObjectKey], where: dict[ObjectKey, int], size_of: Callable[[ObjectKey], int | None]
    ) -> dict[ObjectKey, asyncio.Future[bool]]:
        l1, loop = self.l1, asyncio.get_running_loop()
        by_tier: dict[int, list[Item]] = {}
        futures: dict[ObjectKey, asyncio.Future[bool]] = {}
        for key in keys:
            size = size_of(key)
            entry = None
            if size is not None:
                entry = l1.reserve(key, size)
                if entry is None:
                    break  # L1 is full of objects nobody may evict: load no further
            self.inflight[key] = futures[key] = loop.create_future()
            by_tier.setdefault(where[key], []).append((key, entry, futures[key]))
        for index, items in by_tier.items():
            for i in range(0, len(items), FETCH_BATCH):
                task = asyncio.create_task(self._load(index, items[i : i + FETCH_BATCH]))
                self.background.add(task)
                task.add_done_callback(self.background.discard)
        return futures

    async def _load(self, index: int, items: list[Item]) -> None:
        tier, l1 = self.tiers[index], self.l1
        names = [key_str(k) for k, _, _ in items]
        done: set[ObjectKey] = set()
        try:
            try:
                slots = [None if e is None else l1.arena.read(e.offset, e.size) for _, e, _ in items]
                blobs = await tier.adapter.get_into(names, slots, HEADER_BYTES, self._check)  # fs: into the slots
            except L2Error as exc:
                tier.failed(exc)
                return
            tier.succeeded()
            tier.stats.gets += len(items)
            tier.stats.get_bytes += sum(_blob_len(b, e) for b, (_, e, _) in zip(blobs, items, strict=True))
            entries = [e for _, e, _ in items]
            if all(b is None or (isinstance(b, Landed) and isinstance(b.verdict, int | Exception)) for b in blobs):
                results = self._decode(names, blobs, entries)  # all checked in place: no work left, no hop
            else:
                results = await asyncio.to_thread(self._decode, names, blobs, entries)
            doomed, gone = [], []
            for (key, entry, future), name, result in zip(items, names, results, strict=True):
                if result is None:
                    tier.stats.misses += 1
                    gone.append(key)
                elif isinstance(result, CorruptObject):
                    tier.stats.corrupt += 1
                    doomed.append(name)
                    gone.append(key)
                    log.warning("L2 tier %s: corrupt object deleted (%s)", tier.url, result)
                elif isinstance(result, UndecryptableObject):
                    tier.stats.undecryptable += 1
                elif self._commit(key, entry, result, future):
                    done.add(key)
                    tier.stats.hits += 1
                    self.loaded += 1
            for hook in self.on_missing:
                hook(index, gone)
            if done:
                for loaded in self.on_loaded:
                    loaded(sorted(done, key=lambda k: k[6]))
            if index > 0 and done:
                self.enqueue(sorted(done, key=lambda k: k[6]), tuple(range(index)))  # promote upwards
            if doomed:
                try:
                    await tier.adapter.delete(doomed)
                except L2Error as exc:
                    tier.failed(exc)
        finally:
            for key, entry, future in items:
                if key not in done and entry is not None and l1.entries.get(key) is entry:
                    l1.abort_write(key)
                if self.inflight.get(key) is future:
                    del self.inflight[key]
                if not future.done():
                    future.set_result(False)

    def _decode(
        self, names: list[str], blobs: list[bytes | Landed | None], entries: list[Entry | None]
    ) -> list[object]:
        """Worker thread: check and decode; copy straight into reserved slots whose size matches (a
        blob that landed in its slot is checked there: nothing to copy)."""
        out: list[object] = []
        arena = self.l1.arena
        for name, blob, entry in zip(names, blobs, entries, strict=True):
            if blob is None:
                out.append(None)
                continue
            try:
                if isinstance(blob, Landed):
                    assert entry is not None
                    if isinstance(blob.verdict, int | Exception):  # checked in place by _check
                        out.append(blob.verdict if isinstance(blob.verdict, Exception) else _Loaded(None, blob.verdict))
                        continue
                    blob = blob.head + bytes(arena.read(entry.offset, entry.size))  # not plain: decode whole
                payload, checksum = self.serde.decode_object(name, blob)
            except (CorruptObject, UndecryptableObject) as exc:
                out.append(exc)
                continue
            if entry is not None:
                if len(payload) != entry.size:
                    out.append(CorruptObject(f"payload has {len(payload)} bytes, the layout says {entry.size}"))
                    continue
                arena.write(entry.offset, payload)
                out.append(_Loaded(None, checksum))
            else:
                out.append(_Loaded(payload, checksum))
        return out

    def _check(self, name: str, head: bytes, slot: memoryview) -> object:
        """Run by the tier right after a blob landed in its slot: its kvsum64, None (not a plain
        blob: decode it whole) or the CorruptObject/UndecryptableObject that refuses it."""
        try:
            return self.serde.verify_in_place(name, head, slot)
        except (CorruptObject, UndecryptableObject) as exc:
            return exc

    def _commit(self, key: ObjectKey, entry: Entry | None, result: object, future: asyncio.Future[bool]) -> bool:
        """Make a loaded object READY (reserving now if its size was unknown); False if not possible."""
        l1 = self.l1
        if not isinstance(result, _Loaded):
            return False
        if entry is None:
            if key in l1.entries or result.payload is None:
                return False  # someone stored it meanwhile
            entry = l1.reserve(key, len(result.payload))
            if entry is None:
                return False
            l1.arena.write(entry.offset, result.payload)
        elif l1.entries.get(key) is not entry:
            return False
        entry.checksum = result.checksum  # the writer's checksum travels with the bytes
        l1.finish_write(key)
        for _ in range(self.waiting.get(key, 0)):
            l1.lease(key)  # keep it for the runs waiting on it until they answer
        if self.inflight.get(key) is future:
            del self.inflight[key]
        future.set_result(True)
        return True

    async def cancel_all(self) -> None:
        for task in list(self.background):
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
