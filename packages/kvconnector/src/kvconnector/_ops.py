"""Lookup, load and save as plain functions that raise; EngineClient turns every raise into a result.

Why separate: the API boundary (never raise, rate-limited warnings) stays readable, and the steps
that must happen in a precise order (validate everything, then reserve, copy, verify the arena,
commit; or retrieve, validate the reply, copy, verify) are in one place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from kvprotocol import ErrorCode, ExtraKeys, ServerError, check_extra, pack_tokens

from . import copy as kvcopy
from ._link import Deadline, EngineLink, LeaseLost
from ._transfer import Copier, Moves, check_blocks, load_moves, save_moves

RELEASE_CODES = (ErrorCode.UNKNOWN_SESSION, ErrorCode.NOT_LEASED)
U64_MAX = (1 << 64) - 1


class ChecksumMismatch(Exception):
    """Bytes read from the cache are not the bytes their writer committed: the load failed."""

    def __init__(self, objects: int, chunks: list[int]) -> None:
        super().__init__(f"{objects} object(s) failed verification (chunks {chunks[:8]}): "
                         "corrupt or never written; recomputing")
        self.objects = objects


def as_tokens(tokens: Any) -> np.ndarray:
    """Token ids from a list, numpy array or torch tensor, as a 1-D integer array."""
    if hasattr(tokens, "detach"):
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError("tokens must be one-dimensional")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got {arr.dtype}")
    return arr


def as_tables(block_ids: Any, groups: int) -> list[np.ndarray]:
    """One block table per group: a flat list serves every group, a nested one is per group."""
    if hasattr(block_ids, "detach"):
        block_ids = block_ids.detach().cpu().numpy()
    nested = isinstance(block_ids, np.ndarray) and block_ids.ndim == 2 or (
        not isinstance(block_ids, np.ndarray) and len(block_ids) > 0
        and isinstance(block_ids[0], (list, tuple, np.ndarray)))
    tables = [np.asarray(t, dtype=np.int64).reshape(-1) for t in block_ids] if nested \
        else [np.asarray(block_ids, dtype=np.int64).reshape(-1)] * groups
    if len(tables) != groups:
        raise ValueError(f"{len(tables)} block tables for {groups} object groups")
    return tables


def extra_fields(extra: ExtraKeys, num_chunks: int) -> dict[str, Any]:
    """The wire `extra` field for a request of num_chunks full chunks (keys of later chunks dropped)."""
    pairs = [[i, d] for i, d in check_extra(extra) if i < num_chunks]
    return {"extra": pairs} if pairs else {}


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def load_blocks(link: EngineLink, tables: Sequence[np.ndarray], skip: int, num: int) -> list[int]:
    """Every engine block a load of [skip, num) would write (reported as failed when it fails)."""
    out: set[int] = set()
    for lay, table in zip(link.layouts, tables, strict=False):
        lo, hi = max(0, _ceil(skip, lay.block_size)), min(table.shape[0], _ceil(num, lay.block_size))
        out.update(int(b) for b in table[lo:hi])
    return sorted(out)


def lookup(link: EngineLink, deadline: Deadline, tokens: np.ndarray, salt: str, session: str | None,
           extra: ExtraKeys = (), rank: int | None = None, wait: bool = True) -> tuple[int, bool]:
    """Hit tokens and whether an L2 prefetch is still running (only with wait=False); with a session,
    lease the hit objects of every rank (or of `rank` only) to it."""
    fields: dict[str, Any] = {"keyspace": link.keyspace.to_wire(), "tokens": pack_tokens(tokens), "salt": salt,
                              **extra_fields(extra, tokens.shape[0] // link.layouts[0].chunk_size)}
    if session is not None:
        fields["session"] = session
        if rank is not None:
            fields["rank"] = rank
    if not wait:
        fields["wait"] = False
    result = link.call("lookup", deadline, **fields).result
    if int(result["chunk_size"]) != link.layouts[0].chunk_size:
        raise ServerError(ErrorCode.LAYOUT_MISMATCH, f"server chunk_size {result['chunk_size']} "
                                                     f"!= layout chunk_size {link.layouts[0].chunk_size}")
    return int(result["hit_tokens"]), bool(result.get("pending", False))


@dataclass
class _Objects:
    """Absolute host addresses of the objects of one transfer, per group, in chunk order, and the
    checksums their writers committed."""

    addrs: list[np.ndarray]
    checksums: list[list[int]]
    keepalive: Any = None


def _object_addrs(link: EngineLink, mode: str, objects: list[dict[str, Any]], frames: Sequence[Any],
                  start: int, end: int) -> _Objects:
    groups = len(link.layouts)
    expected = [(c, g) for c in range(start, end) for g in range(groups)]
    got = [(o.get("chunk"), o.get("group")) for o in objects]
    if sorted(got) != expected:
        raise ValueError(f"retrieve returned objects {got[:6]}..., expected chunks [{start}, {end}) of "
                         f"{groups} group(s)")
    if mode == "tcp" and len(frames) != len(objects):
        raise ValueError(f"retrieve returned {len(frames)} data frames for {len(objects)} objects")
    addrs = [np.zeros(end - start, dtype=np.int64) for _ in range(groups)]
    sums = [[0] * (end - start) for _ in range(groups)]
    for i, obj in enumerate(objects):
        c, g = obj["chunk"], obj["group"]
        size = link.layouts[g].object_bytes
        if obj.get("size") != size:
            raise ValueError(f"object of chunk {c} has {obj.get('size')} bytes, layout says {size}")
        checksum = obj.get("checksum")
        if not isinstance(checksum, int) or isinstance(checksum, bool) or not 0 <= checksum <= U64_MAX:
            raise ValueError(f"object of chunk {c} comes without a valid checksum")
        sums[g][c - start] = checksum
        if mode == "shm":
            assert link.arena is not None
            link.arena.check_range(obj.get("offset"), size)
            addrs[g][c - start] = link.arena.address + obj["offset"]
        else:
            if len(frames[i]) != size:
                raise ValueError(f"data frame of chunk {c} has {len(frames[i])} bytes, expected {size}")
            addrs[g][c - start] = kvcopy.address_of(frames[i])
    return _Objects(addrs, sums, frames)


def load(link: EngineLink, copier: Copier, deadline: Deadline, session: str, tokens: np.ndarray,
         tables: Sequence[np.ndarray], skip: int, num: int, salt: str, extra: ExtraKeys = ()) -> int:
    """Write engine blocks covering tokens [skip, num) from the cache; returns the tokens loaded.

    Ends this rank's leases of the session, whatever happens. In shm mode, on success, by a release
    that proves the leases were held until the copy finished (so no slot could have been reused
    under it); if they were not, the copy may hold another object's bytes and the load fails
    (LeaseLost). tcp frames are copies the server took under the lease, so they need no such proof.
    """
    try:
        loaded, lease = _load(link, copier, deadline, session, tokens, tables, skip, num, salt, extra)
    except BaseException:
        _give_back(link, deadline, session)
        raise
    if lease is None:
        _give_back(link, deadline, session)
        return loaded
    result = link.call("release", deadline, session=session, rank=link.rank, lease=lease).result
    if result.get("intact") is not True:
        raise LeaseLost(f"the leases of session {session!r} ended before rank {link.rank}'s copy finished "
                        "(expired or dropped); the copied bytes are not trusted")
    return loaded


def _give_back(link: EngineLink, deadline: Deadline, session: str) -> None:
    """Best effort: return this rank's leases (the server also expires them after its lease TTL)."""
    try:
        link.call("release", _grace(deadline), session=session, rank=link.rank)
    except Exception:
        pass


def _load(link: EngineLink, copier: Copier, deadline: Deadline, session: str, tokens: np.ndarray,
          tables: Sequence[np.ndarray], skip: int, num: int, salt: str, extra: ExtraKeys = ()
          ) -> tuple[int, int | None]:
    """The load itself: (tokens loaded, the lease number an shm copy was made under, else None)."""
    if skip < 0 or num < 0:
        raise ValueError("skip_tokens and num_tokens must be >= 0")
    if num <= skip:
        return 0, None
    chunk = link.layouts[0].chunk_size
    start, end = skip // chunk, _ceil(num, chunk)
    moves: list[Moves] = []
    for g, (lay, table) in enumerate(zip(link.layouts, tables, strict=True)):
        if skip % lay.block_size:
            raise ValueError(f"skip_tokens {skip} is not a multiple of block_size {lay.block_size}: the "
                             "block holding it belongs to the engine and is never overwritten")
        m = load_moves(table, lay.blocks_per_chunk, start, skip // lay.block_size, _ceil(num, lay.block_size))
        check_blocks(m, copier.num_blocks(g), distinct=True)
        moves.append(m)
    mode = link.ensure(deadline)
    fields = {"session": session, "rank": link.rank, "start_chunk": start, "end_chunk": end, "mode": mode}
    try:
        reply = link.call("retrieve", deadline, **fields)
    except ServerError as exc:  # this rank's lease expired or was never taken here: lease again, then retry
        if exc.code not in RELEASE_CODES or tokens.shape[0] < end * chunk:
            raise
        hit, _ = lookup(link, deadline, tokens[: end * chunk], salt, session, extra, rank=link.rank)
        if hit < end * chunk:
            raise ServerError(ErrorCode.NOT_LEASED, f"only {hit} of the {end * chunk} tokens to load are cached "
                                                    "now") from exc
        reply = link.call("retrieve", deadline, **fields)
    lease = reply.result.get("lease")
    if not isinstance(lease, int) or isinstance(lease, bool):
        raise ValueError("retrieve reply carries no lease number")
    objs = _object_addrs(link, mode, reply.result.get("objects", []), reply.frames, start, end)
    bad: list[int] = []
    for g, m in enumerate(moves):  # verified while scattering: a mismatch fails the whole load
        bad += [start + i for i in copier.scatter(g, objs.addrs[g], m, objs.checksums[g])]
    copier.finish()
    if bad:
        raise ChecksumMismatch(len(bad), sorted(set(bad)))
    if mode != "shm":
        return num - skip, None
    link.check_arena()  # the bytes came from the arena the replying server owns
    return num - skip, lease


@dataclass(frozen=True)
class Saved:
    written: int  # chunks with at least one object written by this call
    cached: int  # chunks of the range that are now fully cached (written or already present)
    no_space: int  # chunks the server had no room for


def _store(link: EngineLink, deadline: Deadline, fields: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    mode = link.ensure(deadline)
    try:
        return mode, link.call("store", deadline, keyspace=link.keyspace.to_wire(), mode=mode, **fields).result
    except ServerError as exc:
        if exc.code != ErrorCode.LAYOUT_MISMATCH:
            raise
        link.invalidate()  # a restarted server forgot our layouts: register again, once
        mode = link.ensure(deadline)
        return mode, link.call("store", deadline, keyspace=link.keyspace.to_wire(), mode=mode, **fields).result


def save(link: EngineLink, copier: Copier, deadline: Deadline, tokens: np.ndarray,
         tables: Sequence[np.ndarray], salt: str, skip: int, extra: ExtraKeys = ()) -> Saved:
    """Store every full chunk from the one holding skip_tokens on; reserve, gather, verify, commit."""
    chunk = link.layouts[0].chunk_size
    n = tokens.shape[0] // chunk
    for lay, table in zip(link.layouts, tables, strict=True):
        n = min(n, table.shape[0] // lay.blocks_per_chunk)
    start = max(0, skip) // chunk
    if start >= n:
        return Saved(0, 0, 0)
    for g, (lay, table) in enumerate(zip(link.layouts, tables, strict=True)):
        check_blocks(save_moves(table, lay.blocks_per_chunk, range(start, n)), copier.num_blocks(g), distinct=False)
    fields = {"tokens": pack_tokens(tokens[: n * chunk]), "rank": link.rank, "salt": salt, "start_chunk": start,
              **extra_fields(extra, n)}
    mode, result = _store(link, deadline, fields)
    slots = result.get("slots", [])
    reserved = [s for s in slots if s.get("status") == "reserved"]
    bad = [s for s in slots if not (start <= s.get("chunk", -1) < n and 0 <= s.get("group", -1) < len(link.layouts))]
    if bad:
        raise ValueError(f"store returned slots outside the request: {bad[:3]}")
    full = {s["chunk"] for s in slots if s.get("status") == "no_space"}
    written = {s["chunk"] for s in reserved}
    if reserved:
        _fill_and_commit(link, copier, deadline, mode, result.get("store_id"), reserved, tables)
    return Saved(len(written - full), n - start - len(full), len(full))


def _fill_and_commit(link: EngineLink, copier: Copier, deadline: Deadline, mode: str, store_id: Any,
                     reserved: list[dict[str, Any]], tables: Sequence[np.ndarray]) -> None:
    if not isinstance(store_id, str):
        raise ValueError("store reply has reserved slots but no store_id")
    sizes = [link.layouts[s["group"]].object_bytes for s in reserved]
    try:
        for s, size in zip(reserved, sizes, strict=True):
            if s.get("size") != size:
                raise ValueError(f"slot of chunk {s['chunk']} has {s.get('size')} bytes, layout says {size}")
        frames: list[memoryview] = []
        if mode == "shm":
            assert link.arena is not None
            for s, size in zip(reserved, sizes, strict=True):
                link.arena.check_range(s.get("offset"), size)
            addrs = [link.arena.address + s["offset"] for s in reserved]
        else:
            buf = np.empty(sum(sizes), dtype=np.uint8)
            ends = np.cumsum(sizes)
            frames = [memoryview(buf[e - z : e]) for e, z in zip(ends, sizes, strict=True)]
            addrs = [kvcopy.address_of(buf) + int(e - z) for e, z in zip(ends, sizes, strict=True)]
        checksums: list[int | None] = [None] * len(reserved)
        for g, lay in enumerate(link.layouts):
            idx = [i for i, s in enumerate(reserved) if s["group"] == g]
            if idx:
                moves = save_moves(tables[g], lay.blocks_per_chunk, [reserved[i]["chunk"] for i in idx])
                sums = copier.gather(g, np.asarray([addrs[i] for i in idx], dtype=np.int64), moves)
                for j, i in enumerate(idx):
                    checksums[i] = None if sums is None else sums[j]
        copier.finish()
        # the commit proves the write: the checksum of each object as gathered (or, for copiers that
        # cannot sum while copying, as it lies in host memory once the copy is done)
        proof = [kvcopy.checksum(a, z) if c is None else c for a, z, c in zip(addrs, sizes, checksums, strict=True)]
        if mode == "shm":
            link.check_arena()  # we wrote into the arena of the server that reserved the slots
        link.call("commit", deadline, frames=frames, store_id=store_id, checksums=proof)
    except BaseException:
        try:  # best effort: the server also expires reservations after its lease TTL
            link.call("abort", _grace(deadline), store_id=store_id)
        except Exception:
            pass
        raise


def _grace(deadline: Deadline) -> Deadline:
    return Deadline(max(deadline.remaining(), 0.1))
