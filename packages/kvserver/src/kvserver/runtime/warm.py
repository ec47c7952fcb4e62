"""Warm restart: re-adopt the objects a previous server left in its arena, verified before they serve.

The server is ready (answers, takes new stores) as soon as the adopted slots are reserved; their
bytes are then checked against their kvsum64 in the background, a batch at a time off the loop.
Until its check passes an adopted object is WRITING: no lookup sees it, eviction never takes it.
One that fails is freed. Leases, sessions and pins start empty; tenant charges are rebuilt by the
adoption itself, and objects of a tenant that no longer exists are not adopted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvprotocol import ObjectKey
from kvprotocol.kvsum import kvsum64_array

from ..l1.arena import Arena, check_own
from ..l1.cache import L1Cache, tenant_of
from ..l1.journal import ArenaJournal, journal_path, read_journal
from ..security.tenants import DEFAULT, TenantBook

log = logging.getLogger("kvserver")

BATCH_BYTES = 64 << 20  # verified per step off the loop; the loop runs between steps


class WarmStart:
    """The journal of an L1 arena, and the adoption of what an earlier server left in it."""

    def __init__(self, arena: Arena, l1: L1Cache, tenants: TenantBook) -> None:
        self.arena, self.l1 = arena, l1
        path: Path = journal_path(arena.path)
        check_own(path)
        found, why = read_journal(path, arena.identity, arena.capacity) if arena.adopted else ([], "")
        self.journal = ArenaJournal(path, arena.identity, arena.capacity)
        self.journal.start()
        l1.journal = self.journal
        self.found = len(found)

        def keep(key: ObjectKey) -> bool:
            return (t := tenant_of(key)) == DEFAULT or t in tenants.tenants

        self._pending = l1.adopt(found, keep)
        self.adopted = len(self._pending)
        self.dropped = self.found - self.adopted  # foreign tenant, overlapping or out of range
        self.verified = self.rejected = 0
        self.seconds = 0.0
        if arena.not_adopted:
            log.warning("arena %s: not adopted (%s): starting empty", arena.name, arena.not_adopted)
        elif arena.adopted and why:
            log.warning("arena %s: adopted, but %s: starting empty", arena.name, why)
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
        batch: list[ObjectKey] = []
        size = 0
        for key in self._pending:
            batch.append(key)
            size += self.l1.entries[key].size if key in self.l1.entries else 0
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

    async def _verify(self, keys: list[ObjectKey]) -> None:
        spans = [(k, e.offset, e.size, e.checksum) for k in keys if (e := self.l1.entries.get(k)) is not None]
        view = self.arena.view

        def check() -> list[bool]:
            return [
                kvsum64_array(np.frombuffer(view[off : off + size], dtype=np.uint8)) == want
                for _, off, size, want in spans
            ]

        results = await asyncio.to_thread(check)
        for (key, *_), ok in zip(spans, results, strict=True):
            self.l1.finish_adopt(key, ok)
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

    def close(self, keep: bool) -> None:
        self.journal.close(remove=not keep)
