"""Corrupt reports: a reader's copy found objects whose bytes fail their kvsum64, and its release
names their chunks. The server checks its own bytes and drops what is damaged, from L1 and L2.

Readers verify every object they copy, so a damaged object is never used; without this it would
stay cached and fail every later load of its prefix. An object landed from L2 without a check of its
body (`--l2-verify reader`, l2/prefetch.py) is found this way.

A reader cannot make the server drop an intact object: the server computes the kvsum64 itself and
keeps what matches (marked checked, so a repeated claim costs nothing). The named objects are leased
for the check, which runs on a worker thread (a few objects per release at most), so neither the
event loop nor another reader waits on it.
May import: the service's own modules, `l1`, `l2` (types only).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from kvprotocol import ObjectKey

from ..l1.cache import Entry

if TYPE_CHECKING:
    from .state import CacheState

log = logging.getLogger("kvserver.corruption")

#: objects checked per release at most; the rest of a longer claim is ignored (a load that fails
#: stops at its first damaged chunk, so a true report names few)
MAX_CHECKED = 64

Held = list[tuple[ObjectKey, Entry]]


class CorruptionChecks:
    """Hold the objects a release names, check them off the loop, drop the damaged ones."""

    def __init__(self, state: CacheState) -> None:
        self.state = state
        self.counters = state.counters

    def hold(self, session_id: str, rank: int, chunks: list[int]) -> Held:
        """Lease the objects of `chunks` that the rank's reader holds (call before its release)."""
        st = self.state
        session = st.table.sessions.get(session_id)
        reader = None if session is None else session.readers.get(rank)
        if reader is None:
            return []
        held: Held = []
        for chunk in sorted(set(chunks)):
            if chunk >= reader.hit_chunks or len(held) >= MAX_CHECKED:
                break
            for _, _, key in st.groups.retrieve_objects(
                reader.keyspace, reader.salt, reader.hashes, reader.hit_chunks, rank, chunk, chunk + 1
            ):
                entry = st.l1.ready(key)
                if entry is None or entry.checked or len(held) >= MAX_CHECKED:
                    continue
                st.l1.lease(key)
                held.append((key, entry))
        self.counters.corrupt_reported += len(held)
        return held

    async def settle(self, held: Held) -> int:
        """Check the held objects' bytes, give their leases back, drop the damaged ones: how many."""
        if not held:
            return 0
        l1 = self.state.l1
        try:
            intact = await asyncio.to_thread(self._intact, held)
        finally:
            for key, _ in held:
                l1.unlease(key)
        damaged = [key for (key, _), ok in zip(held, intact, strict=True) if not ok]
        for (_, entry), ok in zip(held, intact, strict=True):
            entry.checked = ok
        self.counters.corrupt_refuted += len(held) - len(damaged)
        self.counters.corrupt_dropped += len(damaged)
        if damaged:
            self._drop(damaged)
        return len(damaged)

    def _intact(self, held: Held) -> list[bool]:
        arena = self.state.l1.arena
        return [arena.kvsum(e.offset, e.size) == e.checksum for _, e in held]

    def _drop(self, keys: list[ObjectKey]) -> None:
        """Out of L1 (unless another reader holds it: its copy fails and reports it again) and out of
        every L2 tier."""
        l1 = self.state.l1
        for key in keys:
            entry = l1.ready(key)
            if entry is not None and not entry.leases:
                l1.remove(key)
                for hook in l1.on_clear:
                    hook(key)
        log.warning("dropped %d object(s) a reader found damaged (kvsum64 mismatch)", len(keys))
        if self.state.l2 is not None:
            self.state.l2.discard(keys)


__all__ = ["MAX_CHECKED", "CorruptionChecks"]
