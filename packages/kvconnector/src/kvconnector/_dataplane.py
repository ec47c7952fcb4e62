"""DataPlane: lookup, load and save of one engine rank as plan -> copy -> verify steps that raise;
EngineClient turns every raise into a result.

Why an object: every step needs the same three things, the link to the server (registration, mode,
arena), the copier (a `engine_kv.Copier`: host memory or CUDA) and the layouts' geometry, so they are
held once instead of passed to every function. Why separate from EngineClient: the API boundary
(never raise, rate-limited warnings) stays readable, and the steps that must happen in a precise
order (validate everything, then reserve, copy, verify the arena, commit; or retrieve, validate the
reply, copy, verify) are in one place.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from kvprotocol import ErrorCode, ExtraKeys, ServerError, check_extra, flows, pack_tokens
from kvprotocol import replies as rp
from kvprotocol import requests as rq

from . import copy as kvcopy
from ._link import Deadline, EngineError, EngineLink, LeaseLost
from .engine_kv import (
    Copier,
    Moves,
    block_range,
    ceil_div,
    check_blocks,
    load_block_ids,
    load_moves,
    save_moves,
    window_base,
    window_moves,
)

U64_MAX = (1 << 64) - 1


class NotStreamed(EngineError):
    """A streamed load's prefetch ended (or its time ran out) before it brought every chunk: the rest failed."""

    KIND = "not_streamed"


class ChecksumMismatch(EngineError, flows.CorruptCopy):
    """Bytes read from the cache are not the bytes their writer committed: the load failed, and the
    release reports the chunks (the server checks and drops them)."""

    KIND = "checksum_mismatch"

    def __init__(self, objects: int, chunks: list[int]) -> None:
        flows.CorruptCopy.__init__(
            self,
            f"{objects} object(s) failed verification (chunks {chunks[:8]}): corrupt or never written; recomputing",
            chunks,
        )
        self.objects = objects


def extra_pairs(extra: ExtraKeys, num_chunks: int) -> list[tuple[int, bytes]] | None:
    """The wire `extra` field for a request of num_chunks full chunks (keys of later chunks dropped)."""
    pairs = [(i, d) for i, d in check_extra(extra) if i < num_chunks]
    return pairs or None


@dataclass(frozen=True)
class Prompt:
    """What a load or save is about: the request's tokens, its block table per group, and what else
    keys its chunks (salt, extra keys)."""

    tokens: np.ndarray
    tables: Sequence[np.ndarray]
    salt: str = ""
    extra: ExtraKeys = ()


@dataclass
class _Objects:
    """Absolute host addresses of the objects of one transfer, per group, in chunk order, and the
    checksums their writers committed."""

    addrs: list[np.ndarray]
    checksums: list[list[int]]
    keepalive: Any = None


@dataclass(frozen=True)
class Saved:
    written: int  # chunks with at least one object written by this call
    cached: int  # chunks of the range that are now fully cached (written or already present)
    no_space: int  # chunks the server had no room for


class DataPlane:
    """One engine rank's lookups, loads and saves over its link and its copier."""

    def __init__(self, link: EngineLink) -> None:
        self.link = link
        self.copier: Copier | None = None  # set by `use` once the engine's KV tensors are known

    def use(self, copier: Copier) -> None:
        """Copy with `copier` from now on: the old copier lets go of the arena, the new one takes it."""
        if self.copier is not None:
            self.copier.detach_arena()
        self.copier = copier
        if self.link.arena is not None:
            copier.attach_arena(self.link.arena.address, self.link.arena.size)

    def ensure(self, deadline: Deadline) -> str:
        """Registered, with a current arena mapping (the copier told of a new one); "shm" or "tcp"."""
        return self.link.ensure(deadline, self.copier)

    def close(self) -> None:
        self.link.close(self.copier)
        self.copier = None

    def _copier(self) -> Copier:
        if self.copier is None:
            raise ValueError("register(kv_caches) must be called before load or save")
        return self.copier

    # -- lookup -------------------------------------------------------------------------------------
    def lookup(
        self,
        deadline: Deadline,
        tokens: np.ndarray,
        salt: str,
        session: str | None,
        extra: ExtraKeys = (),
        rank: int | None = None,
        wait: bool = True,
        expect: bool = False,
        progress: bool = False,
        tails: bool = False,
    ) -> tuple[int, bool, bool, int | None]:
        """(hit tokens, whether an L2 prefetch still runs (only with wait=False), whether a producer is
        still writing the chunk the hit stops at, the tokens L1 + that prefetch will cover (with
        expect, else None)); with a session, lease the hit objects of every rank (or of `rank` only) to it."""
        req = self.lookup_request(tokens, salt, session, extra, rank, wait, expect, progress, tails)
        return self.lookup_answer(self.link.send(req, deadline)[0])

    def lookup_request(
        self,
        tokens: np.ndarray,
        salt: str,
        session: str | None,
        extra: ExtraKeys = (),
        rank: int | None = None,
        wait: bool = True,
        expect: bool = False,
        progress: bool = False,
        tails: bool = False,
    ) -> rq.Lookup:
        return rq.Lookup(
            **self._names(tokens, salt, extra),
            session=session,
            rank=rank if session is not None else None,
            wait=wait,
            expect=expect,
            progress=progress,
            tails=tails and not extra,
        )

    def announce_request(
        self, tokens: np.ndarray, salt: str, session: str, extra: ExtraKeys, start_chunk: int, ttl_s: float
    ) -> rq.Announce:
        return rq.Announce(**self._names(tokens, salt, extra), session=session, start_chunk=start_chunk, ttl_s=ttl_s)

    def _names(self, tokens: np.ndarray, salt: str, extra: ExtraKeys) -> dict[str, Any]:
        """The fields a request naming the objects of `tokens` carries (kvprotocol's KeysRequest)."""
        link = self.link
        return {
            "keyspace": link.keyspace_wire,
            "tokens": pack_tokens(tokens),
            "salt": salt,
            "extra": extra_pairs(extra, tokens.shape[0] // link.unit),
        }

    def lookup_answer(self, result: rp.LookupReply) -> tuple[int, bool, bool, int | None]:
        """(hit tokens, pending, inflight, expected tokens) of a lookup reply; a server of another chunk
        size is an error."""
        if result.chunk_size != self.link.unit:
            raise ServerError(
                ErrorCode.LAYOUT_MISMATCH,
                f"server chunk_size {result.chunk_size} != layout chunk_size {self.link.unit}",
            )
        expected = result.expected_tokens
        if expected is not None and not result.hit_tokens <= expected <= result.num_chunks * result.chunk_size:
            raise ValueError(f"lookup answered expected_tokens {expected} outside [hit, prompt]")
        return result.hit_tokens, bool(result.pending), bool(result.inflight), expected

    # -- load ---------------------------------------------------------------------------------------
    def load_blocks(self, tables: Sequence[np.ndarray], skip: int, num: int) -> list[int]:
        """Every engine block a load of [skip, num) would write (reported as failed when it fails)."""
        link = self.link
        return load_block_ids(link.geoms, link.layouts, tables, skip, num, link.unit)

    def load(self, deadline: Deadline, session: str, prompt: Prompt, skip: int, num: int) -> int:
        """Write engine blocks covering tokens [skip, num) from the cache; returns the tokens loaded.

        Ends this rank's leases of the session, whatever happens (kvprotocol.flows.read_leased). In shm
        mode, on success, by a release that proves the leases were held until the copy finished (so no
        slot could have been reused under it); if they were not, the copy may hold another object's
        bytes and the load fails (LeaseLost). tcp frames are copies the server took under the lease, so
        they need no such proof.
        """
        link = self.link
        try:
            copier = self._copier()
            planned = self._plan_load(copier, skip, num, prompt.tables)
            mode = self.ensure(deadline) if planned is not None else "tcp"
        except BaseException:
            self._give_back(deadline, session)
            raise
        if planned is None:
            self._give_back(deadline, session)
            return 0
        start, end, moves, objs_of = planned
        chunk = link.unit
        tokens = prompt.tokens

        def relookup() -> None:  # this rank's lease expired or was never taken here: lease again
            hit, _, _, _ = self.lookup(
                deadline, tokens[: end * chunk], prompt.salt, session, prompt.extra, rank=link.rank
            )
            if hit < end * chunk:
                raise ServerError(
                    ErrorCode.NOT_LEASED, f"only {hit} of the {end * chunk} tokens to load are cached now"
                )

        def copy(reply: rp.RetrieveReply, frames: list[memoryview]) -> int:
            objs = self._object_addrs(mode, reply.objects, frames, objs_of)
            bad: list[int] = []
            try:
                for g, m in enumerate(moves):  # verified while scattering: a mismatch fails the whole load
                    geo = link.geoms[g]
                    failed = copier.scatter(g, objs.addrs[g], m, objs.checksums[g])
                    bad += [geo.end_unit(objs_of[g].start + i) for i in failed]
            finally:  # copies already issued end before any lease is released, even when one raised
                copier.finish()
            if bad:
                raise ChecksumMismatch(len(bad), sorted(set(bad)))
            if mode == "shm":
                link.check_arena()  # the bytes came from the arena the replying server owns
            return num - skip

        req = rq.Retrieve(
            session=session, rank=link.rank, start_chunk=start, end_chunk=end, mode="shm" if mode == "shm" else "tcp"
        )
        try:
            return flows.read_leased(
                link.sender(deadline),
                req,
                copy,
                prove=mode == "shm",
                relookup=relookup if tokens.shape[0] >= end * chunk else None,
                release_send=link.sender(_grace(deadline)),
            )
        except flows.LeaseBroken as exc:
            raise LeaseLost(str(exc)) from exc

    def load_streamed(
        self, deadline: Deadline, session: str, prompt: Prompt, skip: int, num: int, poll_s: float
    ) -> tuple[int, Exception | None]:
        """Load tokens [skip, num) while an L2 prefetch brings them into L1: (where the loaded range
        ends, the failure that stopped it or None).

        Each round leases what L1 holds (a lookup of this rank, wait=False, which the server answers
        once the chunk the hit stops at has landed or the prefetch ended) and loads the chunks
        that landed since the last round (`load`: retrieve, copy, verify, release with proof), until the
        range is loaded, or the prefetch ended (`pending` false) or the deadline passed short of it:
        then [end, num) failed. Blocks before the end were copied and verified. With layouts whose
        objects are not one per chunk (windows, states, shared), nothing is loaded before the whole
        range is in L1 (a piece of those is not the range's KV).
        """
        link = self.link
        piecewise = all(geo.trivial for geo in link.geoms)
        loaded, tokens = skip, prompt.tokens
        try:
            while loaded < num:
                hit, pending, _, _ = self.lookup(  # answered once the next chunk landed (or the prefetch ended)
                    deadline,
                    tokens,
                    prompt.salt,
                    session,
                    prompt.extra,
                    rank=link.rank,
                    wait=False,
                    expect=True,
                    progress=True,
                )
                upto = min(hit, num)
                if upto > loaded and (piecewise or upto == num):
                    self.load(deadline, session, prompt, loaded, upto)  # ends this rank's leases
                    loaded = upto
                    continue
                if not pending:
                    raise NotStreamed(f"the L2 prefetch ended with {hit} of {num} tokens in L1")
                if deadline.remaining() <= poll_s:
                    raise NotStreamed(f"{hit} of {num} tokens in L1 when the load's time ran out")
                time.sleep(poll_s)
        except Exception as exc:
            self._give_back(deadline, session)
            return loaded, exc
        return loaded, None

    def release(self, deadline: Deadline, session: str, rank: int | None) -> None:
        """Return the session's leases of `rank` (None: of every rank) over the link, waiting for the
        server's answer; raises. kvconnector's one confirmed release (EngineClient.release and a
        failed load's give-back); the shm load's proof release is flows.read_leased's."""
        self.link.send(rq.Release(session=session, rank=rank), deadline)

    def _give_back(self, deadline: Deadline, session: str) -> None:
        """Best effort: return this rank's leases (the server also expires them after its lease TTL)."""
        try:
            self.release(_grace(deadline), session, self.link.rank)
        except Exception:
            pass

    def _plan_load(
        self, copier: Copier, skip: int, num: int, tables: Sequence[np.ndarray]
    ) -> tuple[int, int, list[Moves], list[range]] | None:
        """(first unit, end unit, block moves per group, object indices per group) of a load of tokens
        [skip, num); None: nothing to load."""
        if skip < 0 or num < 0:
            raise ValueError("skip_tokens and num_tokens must be >= 0")
        if num <= skip:
            return None
        link = self.link
        chunk = link.unit
        start, end = skip // chunk, ceil_div(num, chunk)
        moves: list[Moves] = []
        objs_of: list[range] = []
        for g, (geo, lay, table) in enumerate(zip(link.geoms, link.layouts, tables, strict=True)):
            if skip % lay.block_size:
                raise ValueError(
                    f"skip_tokens {skip} is not a multiple of block_size {lay.block_size}: the "
                    "block holding it belongs to the engine and is never overwritten"
                )
            if geo.kind == "state" and num % lay.chunk_size:
                raise ValueError(
                    f"num_tokens {num}: a recurrent state is usable only at a multiple of its "
                    f"chunk size {lay.chunk_size}"
                )
            objs = range(start, end) if geo.trivial else geo.overlapping(geo.needed(end, chunk), start, end)
            lo, hi = block_range(geo, lay, skip, num, chunk)
            if geo.kind == "state" and lo * lay.block_size < skip:
                raise ValueError("the state's blocks lie before skip_tokens (they belong to the engine)")
            if geo.exact:
                m = window_moves(table, window_base(lay, end - 1, chunk), lo, hi)
            else:
                m = load_moves(table, lay.blocks_per_chunk, objs.start, lo, hi)
            if m.obj.size and (int(m.obj.min()) < 0 or int(m.obj.max()) >= len(objs)):
                raise ValueError("the load's blocks lie outside the objects a hit provides")
            check_blocks(m, copier.num_blocks(g), distinct=True)
            moves.append(m)
            objs_of.append(objs)
        return start, end, moves, objs_of

    def _object_addrs(
        self, mode: str, objects: list[rp.RetrievedObject], frames: Sequence[Any], objs: Sequence[range]
    ) -> _Objects:
        """Addresses of the retrieved objects; objs[g] are the object indices of group g the load expects."""
        link = self.link
        groups = len(link.layouts)
        expected = sorted((link.geoms[g].end_unit(j), g) for g in range(groups) for j in objs[g])
        got = [(o.chunk, o.group) for o in objects]
        if sorted(got) != expected:
            raise ValueError(f"retrieve returned objects {got[:6]}..., expected {expected[:6]}... of {groups} group(s)")
        if mode == "tcp" and len(frames) != len(objects):
            raise ValueError(f"retrieve returned {len(frames)} data frames for {len(objects)} objects")
        addrs = [np.zeros(len(objs[g]), dtype=np.int64) for g in range(groups)]
        sums = [[0] * len(objs[g]) for g in range(groups)]
        for i, obj in enumerate(objects):
            c, g = obj.chunk, obj.group
            pos = (c + 1) // link.geoms[g].units - 1 - objs[g].start  # position among the group's objects
            size = link.layouts[g].object_bytes
            if obj.size != size:
                raise ValueError(f"object of chunk {c} has {obj.size} bytes, layout says {size}")
            if not 0 <= obj.checksum <= U64_MAX:
                raise ValueError(f"object of chunk {c} comes without a valid checksum")
            sums[g][pos] = obj.checksum
            if mode == "shm":
                assert link.arena is not None
                link.arena.check_range(obj.offset, size)
                addrs[g][pos] = link.arena.address + cast(int, obj.offset)
            else:
                if len(frames[i]) != size:
                    raise ValueError(f"data frame of chunk {c} has {len(frames[i])} bytes, expected {size}")
                addrs[g][pos] = kvcopy.address_of(frames[i])
        return _Objects(addrs, sums, frames)

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
        result = flows.store_and_commit(send, req, fill, abort_send=lambda r, f: link.sender(_grace(deadline))(r, f))
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


def _grace(deadline: Deadline) -> Deadline:
    return Deadline(max(deadline.remaining(), 0.1))
