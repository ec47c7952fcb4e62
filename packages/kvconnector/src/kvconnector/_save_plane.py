"""The save half of DataPlane: validate everything, reserve, gather out of the engine's KV, verify the
arena, commit (or abort). A mixin of DataPlane (_dataplane.py), which holds the link and the copier."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from kvprotocol import ErrorCode, ServerError, flows, pack_tokens
from kvprotocol import replies as rp
from kvprotocol import requests as rq

from . import copy as kvcopy
from ._link import Deadline, EngineLink, grace
from ._prompt import Prompt, extra_pairs
from .engine_kv import Copier, Moves, ceil_div, check_blocks, save_moves, window_base, window_moves


@dataclass(frozen=True)
class Saved:
    written: int  # chunks with at least one object written by this call
    cached: int  # chunks of the range that are now fully cached (written or already present)
    no_space: int  # chunks the server had no room for


class SavePlane:
    """Saves of one engine rank; DataPlane sets `link` and provides `ensure` and `_copier`."""

    link: EngineLink

    def ensure(self, deadline: Deadline) -> str:
        raise NotImplementedError

    def _copier(self) -> Copier:
        raise NotImplementedError

    def save(
        self,
        deadline: Deadline,
        prompt: Prompt,
        skip: int,
        reservation: str | None = None,
        total_chunks: int | None = None,
        tail: bool = False,
    ) -> Saved:
        """Store every full chunk from the one holding skip_tokens on: reserve, gather, verify, commit
        (kvprotocol.flows.store_and_commit: a reservation is always committed or aborted). With `tail`,
        the tokens past the last full chunk too, as a tail object (when the server takes tails, the
        blocks cover them, and nothing else rules them out: extra keys, a reservation, a geometry)."""
        link, copier = self.link, self._copier()
        tokens, tables, salt, extra = prompt.tokens, prompt.tables, prompt.salt, prompt.extra
        chunk = link.unit
        n = full = tokens.shape[0] // chunk
        for geo, lay, table in zip(link.geoms, link.layouts, tables, strict=True):
            cover = table.shape[0] * lay.block_size // chunk  # units the block table covers
            n = min(n, cover if geo.exact else cover // geo.units * geo.units)
        start = max(0, skip) // chunk
        tail_len = tokens.shape[0] - n * chunk if tail and n == full and not extra and reservation is None else 0
        if tail_len and not all(
            t.shape[0] * lay.block_size >= tokens.shape[0] for lay, t in zip(link.layouts, tables, strict=True)
        ):
            tail_len = 0
        if start >= n and not tail_len:
            return Saved(0, 0, 0)
        mode = self.ensure(deadline)
        if tail_len and not link.tails:
            tail_len = 0  # an older server, or groups a tail cannot serve
            if start >= n:
                return Saved(0, 0, 0)
        last = n + 1 if tail_len else n  # the tail is chunk n
        for g, geo in enumerate(link.geoms):
            objs = range(start, last) if geo.trivial else geo.stored(start, n, chunk)
            check_blocks(
                self._save_moves(g, tables[g], [geo.end_unit(j) for j in objs], tail_len),
                copier.num_blocks(g),
                distinct=False,
            )
        req = rq.Store(
            keyspace=link.keyspace_wire,
            tokens=pack_tokens(tokens[: n * chunk + tail_len]),
            rank=link.rank,
            salt=salt,
            start_chunk=start,
            extra=extra_pairs(extra, n),
            mode="shm" if mode == "shm" else "tcp",
            reservation=reservation,
            total_chunks=total_chunks if reservation is not None else None,
            tail=bool(tail_len),
        )

        def send(r: rq.Request, frames: Sequence[Any]) -> tuple[rp.Reply_, list[memoryview]]:
            nonlocal mode
            try:
                return link.send(r, deadline, frames)
            except ServerError as exc:
                if not isinstance(r, rq.Store) or exc.code != ErrorCode.LAYOUT_MISMATCH:
                    raise
                link.invalidate()  # a restarted server forgot our layouts: register again, once
                mode = self.ensure(deadline)
                r.mode = "shm" if mode == "shm" else "tcp"
                return link.send(r, deadline, frames)

        def fill(reply: rp.StoreReply, reserved: list[rp.StoreSlot]) -> tuple[list[memoryview], list[int]]:
            self._check_slots(reply, start, last)
            return self._gather(copier, mode, reserved, tables, n if tail_len else None, tail_len)

        # the abort's grace is taken when it is sent: after a stall (a stopped process) the deadline
        # is long past, and the server must still hear that the copy ended (service/late_writers.py)
        result = flows.store_and_commit(send, req, fill, abort_send=lambda r, f: link.sender(grace(deadline))(r, f))
        self._check_slots(result, start, last)
        no_room = {s.chunk for s in result.slots if s.status == "no_space"}
        written = {s.chunk for s in result.slots if s.status == "reserved"}
        return Saved(len(written - no_room), last - start - len(no_room), len(no_room))

    def _check_slots(self, reply: rp.StoreReply, start: int, n: int) -> None:
        link = self.link
        bad = [
            s
            for s in reply.slots
            if not (
                start <= s.chunk < n
                and 0 <= s.group < len(link.layouts)
                and (s.chunk + 1) % link.geoms[s.group].units == 0
            )
        ]
        if bad:
            raise ValueError(f"store returned slots outside the request: {bad[:3]}")

    def _gather(
        self,
        copier: Copier,
        mode: str,
        reserved: list[rp.StoreSlot],
        tables: Sequence[np.ndarray],
        tail_chunk: int | None = None,
        tail_len: int = 0,
    ) -> tuple[list[memoryview], list[int]]:
        """Copy the reserved chunks out of the engine's KV into their slots (shm) or frames (tcp);
        returns (frames, one checksum per slot): the commit's proof of the write. A tail (chunk
        `tail_chunk`, `tail_len` tokens) fills the blocks holding its tokens; its other slots hold zeros."""
        link = self.link
        sizes = [link.layouts[s.group].object_bytes for s in reserved]
        for s, size in zip(reserved, sizes, strict=True):
            if s.size != size:
                raise ValueError(f"slot of chunk {s.chunk} has {s.size} bytes, layout says {size}")
        frames: list[memoryview] = []
        if mode == "shm":
            assert link.arena is not None
            for s, size in zip(reserved, sizes, strict=True):
                link.arena.check_range(s.offset, size)
            addrs = [link.arena.address + cast(int, s.offset) for s in reserved]
        else:
            buf = np.empty(sum(sizes), dtype=np.uint8)
            ends = np.cumsum(sizes)
            frames = [memoryview(buf[e - z : e]) for e, z in zip(ends, sizes, strict=True)]  # type: ignore[arg-type]
            addrs = [kvcopy.address_of(buf) + int(e - z) for e, z in zip(ends, sizes, strict=True)]
        checksums: list[int | None] = [None] * len(reserved)
        try:
            for g in range(len(link.layouts)):
                idx = [i for i, s in enumerate(reserved) if s.group == g]
                if idx:
                    chunks = [reserved[i].chunk for i in idx]
                    tail_here = tail_len if chunks[-1] == tail_chunk else 0
                    moves = self._save_moves(g, tables[g], chunks, tail_here)
                    self._zero_before_start(g, [addrs[i] for i in idx], chunks)
                    if tail_here:
                        self._zero_after_tail(g, addrs[idx[-1]], tail_here)
                    sums = copier.gather(g, np.asarray([addrs[i] for i in idx], dtype=np.int64), moves)
                    for j, i in enumerate(idx):
                        checksums[i] = None if sums is None else sums[j]
        finally:  # copies already issued end before the commit or the abort, even when one raised
            copier.finish()
        # the checksum of each object as gathered (or, for copiers that cannot sum while copying, as it
        # lies in host memory once the copy is done)
        proof = [kvcopy.checksum(a, z) if c is None else c for a, z, c in zip(addrs, sizes, checksums, strict=True)]
        if mode == "shm":
            link.check_arena()  # we wrote into the arena of the server that reserved the slots
        return frames, proof

    def _save_moves(self, g: int, table: np.ndarray, end_units: list[int], tail_len: int = 0) -> Moves:
        """Moves that fill the objects of group g ending at end_units (kvprotocol._geometry names an object
        by the unit it ends at): whole chunks, or for an exact kind the blocks ending at its boundary;
        with `tail_len`, the last object is a tail: only the blocks holding its tokens."""
        link = self.link
        geo, lay = link.geoms[g], link.layouts[g]
        if not geo.exact:
            last = ceil_div(tail_len, lay.block_size) if tail_len else None
            return save_moves(table, lay.blocks_per_chunk, [(c + 1) // geo.units - 1 for c in end_units], last)
        bases = [window_base(lay, c, link.unit) for c in end_units]
        parts = [window_moves(table, b, b, b + lay.blocks_per_chunk) for b in bases]
        for i, m in enumerate(parts):
            m.obj[:] = i
        cat = [
            np.concatenate([getattr(m, f) for m in parts]) if parts else np.zeros(0, dtype=np.int64)
            for f in ("obj", "slot", "block")
        ]
        return Moves(*cat)

    def _zero_before_start(self, g: int, addrs: list[int], end_units: list[int]) -> None:
        """A window snapshot near the start of a prompt has slots before token 0: they hold zeros."""
        link = self.link
        lay = link.layouts[g]
        for addr, c in zip(addrs, end_units, strict=True):
            missing = -window_base(lay, c, link.unit)
            if link.geoms[g].exact and missing > 0:
                self._zero_slots(g, addr, 0, missing)

    def _zero_after_tail(self, g: int, addr: int, tail_len: int) -> None:
        """A tail's object slots past the blocks of its tokens hold zeros."""
        lay = self.link.layouts[g]
        used = ceil_div(tail_len, lay.block_size)
        self._zero_slots(g, addr, used, lay.blocks_per_chunk - used)

    def _zero_slots(self, g: int, addr: int, first: int, count: int) -> None:
        """Zero `count` block slots from `first` in every layer of the object at `addr`: slots no copy
        fills never keep whatever the reserved slot held before (another object's bytes, perhaps
        another tenant's)."""
        if count <= 0:
            return
        lay = self.link.layouts[g]
        per_layer = lay.blocks_per_chunk * lay.block_bytes
        for layer in range(lay.num_layers):
            ctypes.memset(addr + layer * per_layer + first * lay.block_bytes, 0, count * lay.block_bytes)


__all__ = ["SavePlane", "Saved"]
