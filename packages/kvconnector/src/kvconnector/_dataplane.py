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

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from kvprotocol import ErrorCode, ExtraKeys, ServerError, flows, pack_tokens
from kvprotocol import replies as rp
from kvprotocol import requests as rq

from . import copy as kvcopy
from ._link import Deadline, EngineError, EngineLink, LeaseLost, grace
from ._prompt import Prompt, extra_pairs
from ._save_plane import SavePlane
from .engine_kv import (
    Copier,
    Moves,
    block_range,
    ceil_div,
    check_blocks,
    load_block_ids,
    load_moves,
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


@dataclass
class _Objects:
    """Absolute host addresses of the objects of one transfer, per group, in chunk order, and the
    checksums their writers committed."""

    addrs: list[np.ndarray]
    checksums: list[list[int]]
    keepalive: Any = None


class DataPlane(SavePlane):
    """One engine rank's lookups, loads and saves over its link and its copier (saves: SavePlane)."""

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
                release_send=link.sender(grace(deadline)),
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
            self.release(grace(deadline), session, self.link.rank)
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
