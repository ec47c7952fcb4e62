"""Warm restart: re-adopt the objects a previous server left in its segments, verified before they serve.

Both segments are adopted the same way: the L1 arena (KV objects) and the encoder cache's segment
(`-ec`), each from its own journal. The server is ready (answers, takes new stores) as soon as the
adopted ranges are reserved; their bytes are then checked against their kvsum64 in the background,
a batch at a time off the loop. Until its check passes an adopted object is invisible (L1: WRITING;
EC: not ready): no lookup sees it, eviction never takes it. One that fails is freed. Leases,
sessions and pins start empty; tenant charges are rebuilt by the adoption itself, and objects of a
tenant that no longer exists are not adopted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from kvprotocol import ObjectKey

from ..ec.cache import ECCache
from ..ec.journal import ECCommitted, ec_journal, read_ec_journal
from ..l1.arena import Arena, check_own
from ..l1.cache import L1Cache, tenant_of
from ..l1.journal import ArenaJournal, Committed, journal_path, read_journal
from ..security.tenants import DEFAULT, TenantBook

log = logging.getLogger("kvserver")

BATCH_BYTES = 64 << 20  # verified per step off the loop; the loop runs between steps

K = TypeVar("K", bound=Hashable)
Span = tuple[int, int, int]  # offset, size, kvsum64


class Adoption(Generic[K]):
    """One segment's adoption: how many objects its journal named, took back, verified and rejected."""

    def __init__(
        self,
        arena: Arena,
        found: int,
        pending: list[K],
        span: Callable[[K], Span | None],
        finish: Callable[[K, bool], None],
        why_not: str,
    ) -> None:
        self.arena, self._span, self._finish = arena, span, finish
        self.found = found
        self._pending = pending
        self.adopted = len(pending)
        self.dropped = found - self.adopted  # foreign tenant, overlapping or out of range
        self.verified = self.rejected = 0
        self.seconds = 0.0
        if arena.not_adopted:
            log.warning("arena %s: not adopted (%s): starting empty", arena.name, arena.not_adopted)
        elif arena.adopted and why_not:
            log.warning("arena %s: adopted, but %s: starting empty", arena.name, why_not)
        elif arena.adopted:
            log.info(
                "arena %s: adopting %d objects (%d dropped), verifying them", arena.name, self.adopted, self.dropped
            )

    @property
    def pending(self) -> int:
        return self.adopted - self.verified - self.rejected

    async def run(self) -> None:
        """Check every adopted object's bytes and make it ready (or free it), a batch at a time."""
        t0 = time.perf_counter()
        batch: list[tuple[K, Span]] = []
        size = 0
        for key in self._pending:
            span = self._span(key)
            if span is None:  # gone meanwhile (cannot happen today: nothing else touches it)
                self.rejected += 1
                continue
            batch.append((key, span))
            size += span[1]
            if size >= BATCH_BYTES:
                await self._verify(batch)
                batch, size = [], 0
        if batch:
            await self._verify(batch)
        self._pending = []
        self.seconds = time.perf_counter() - t0
        if self.adopted:
            log.info(
                "arena %s: %d adopted objects verified, %d failed their checksum (%.2fs)",
                self.arena.name,
                self.verified,
                self.rejected,
                self.seconds,
            )

    async def _verify(self, batch: list[tuple[K, Span]]) -> None:
        arena = self.arena

        def check() -> list[bool]:
            return [arena.kvsum(off, size) == want for _, (off, size, want) in batch]

        results = await asyncio.to_thread(check)
        for (key, _), ok in zip(batch, results, strict=True):
            self._finish(key, ok)
            self.verified += ok
            self.rejected += not ok

    def describe(self) -> dict[str, Any]:
        return {
            "adopted_arena": self.arena.adopted,
            "found": self.found,
            "adopted": self.adopted,
            "dropped": self.dropped,
            "verified": self.verified,
            "rejected": self.rejected,
            "pending": self.pending,
            "verify_s": round(self.seconds, 3),
        }


def adopt_l1(arena: Arena, l1: L1Cache, tenants: TenantBook) -> tuple[Adoption[ObjectKey], ArenaJournal[Committed]]:
    """Start the L1 arena's journal and take back what the previous server's journal names."""
    path = journal_path(arena.path)
    check_own(path)
    found, why = read_journal(path, arena.identity, arena.capacity) if arena.adopted else ([], "")
    journal: ArenaJournal[Committed] = ArenaJournal(path, arena.identity, arena.capacity)
    journal.start()
    l1.journal = journal

    def keep(key: ObjectKey) -> bool:
        return (t := tenant_of(key)) == DEFAULT or t in tenants.tenants

    def span(key: ObjectKey) -> Span | None:
        e = l1.entries.get(key)
        return None if e is None else (e.offset, e.size, e.checksum)

    return Adoption(arena, len(found), l1.adopt(found, keep), span, l1.finish_adopt, why), journal


def adopt_ec(
    arena: Arena, ec: ECCache, tenants: TenantBook
) -> tuple[Adoption[tuple[str, str, str, str]], ArenaJournal[ECCommitted]]:
    """The same for the encoder cache's segment."""
    check_own(journal_path(arena.path))
    found, why = read_ec_journal(arena.path, arena.identity, arena.capacity) if arena.adopted else ([], "")
    journal = ec_journal(arena.path, arena.identity, arena.capacity)
    journal.start()
    ec.journal = journal

    def keep(tenant: str) -> bool:
        return tenant == DEFAULT or tenant in tenants.tenants

    def span(key: tuple[str, str, str, str]) -> Span | None:
        e = ec.entries.get(key)
        return None if e is None else (e.offset, e.size, e.checksum)

    return Adoption(arena, len(found), ec.adopt(found, keep), span, ec.finish_adopt, why), journal


class WarmStart:
    """The journals of both segments, and the adoption of what an earlier server left in them."""

    def __init__(self, arena: Arena, l1: L1Cache, ec_arena: Arena, ec: ECCache, tenants: TenantBook) -> None:
        self._journals: list[ArenaJournal[Any]] = []
        self.l1, journal = adopt_l1(arena, l1, tenants)
        self._journals.append(journal)
        try:
            self.ec, ec_journal_ = adopt_ec(ec_arena, ec, tenants)
        except BaseException:
            self.close(keep=True)  # a journal left beside an arena is only read if that arena is adopted
            raise
        self._journals.append(ec_journal_)

    @property
    def pending(self) -> int:
        return self.l1.pending + self.ec.pending

    async def run(self) -> None:
        await self.l1.run()
        await self.ec.run()

    def describe(self) -> dict[str, Any]:
        """L1's figures, and the encoder cache's under "ec"."""
        return {**self.l1.describe(), "ec": self.ec.describe()}

    def close(self, keep: bool) -> None:
        for journal in self._journals:
            journal.close(remove=not keep)
