"""Trace-driven hit-rate simulation: the real L1 code (allocator, prefix index, policies) replayed
in-process over a Mooncake-format trace, next to Belady's offline optimum and plain LRU.

Trace format (Mooncake FAST'25 release, JSONL): `timestamp`, `input_length`, `output_length`,
`hash_ids` (one per 512-token block; equal ids mean equal prefixes; the last block may be partial).
Only full blocks are cacheable, one object per block. A request's token hit is its longest resident
prefix of blocks times the block size, as in a server lookup. The token hit rate is hit tokens over
all input tokens.
"""

from __future__ import annotations

import heapq
import json
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from kvprotocol import ObjectKey

from kvserver.l1.arena import Arena
from kvserver.l1.eviction import EvictionPolicy, make_policy
from kvserver.l1.cache import L1Cache

BLOCK_TOKENS = 512
OBJECT_BYTES = 4096  # one allocation unit per block: capacity in blocks = arena bytes / 4096


@dataclass(frozen=True, slots=True)
class Request:
    blocks: tuple[int, ...]  # hash ids of the full (cacheable) blocks
    input_tokens: int


def load_trace(path: str | Path, limit: int | None = None) -> list[Request]:
    out = []
    with open(path) as fh:
        for line in fh:
            if not line.strip():
                continue
            rec = json.loads(line)
            full = rec["input_length"] // BLOCK_TOKENS
            out.append(Request(tuple(rec["hash_ids"][:full]), int(rec["input_length"])))
            if limit is not None and len(out) >= limit:
                break
    return out


def unique_blocks(trace: Iterable[Request]) -> int:
    return len({b for r in trace for b in r.blocks})


def block_of(key: ObjectKey) -> int:
    """The trace hash id a simulated key stands for."""
    return int.from_bytes(key.chunk_hash, "big")


def _key(block: int) -> ObjectKey:
    return ObjectKey("trace", "0" * 16, 1, 0, 0, "", block.to_bytes(32, "big"))


class _SimArena:
    """What L1Cache needs of an arena when nobody maps it: its capacity."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity


def simulate(
    trace: list[Request],
    policy: str | EvictionPolicy[ObjectKey],
    capacity_blocks: int,
    inherit: bool = False,
    on_request: Callable[[int, Request], None] | None = None,
) -> float:
    """Token hit rate of the server's own L1 code (lookup, touch, store, commit order as cache.py).

    `policy`: a name, or a policy object (tracebounds.py's calibrated ones); `on_request(i, request)`
    runs before each request is replayed.
    """
    policy = make_policy(policy) if isinstance(policy, str) else policy
    l1 = L1Cache(cast(Arena, _SimArena(capacity_blocks * OBJECT_BYTES)), policy)
    hit_tokens = total = 0
    for i, req in enumerate(trace):
        if on_request is not None:
            on_request(i, req)
        total += req.input_tokens
        keys = [_key(b) for b in req.blocks]
        hit = 0
        for k in keys:
            if l1.ready(k) is None:
                break
            hit += 1
        l1.touch_many(keys[:hit][::-1])  # as cache.py's lookup: tail first, one call
        hit_tokens += hit * BLOCK_TOKENS
        written = _store_missing(l1, keys, req.blocks, hit)
        if inherit and hit >= 2:
            for k in reversed(written):
                l1.touch(k)
    return hit_tokens / max(1, total)


def plain_lru(trace: list[Request], capacity_blocks: int) -> float:
    """Object-level LRU without prefix awareness (what L1 did before): heads touched and stored
    first, so a prefix loses its head first."""
    cache: OrderedDict[int, None] = OrderedDict()
    hit_tokens = total = 0
    for req in trace:
        total += req.input_tokens
        hit = 0
        for b in req.blocks:
            if b not in cache:
                break
            hit += 1
        for b in req.blocks[:hit]:
            cache.move_to_end(b)
        hit_tokens += hit * BLOCK_TOKENS
        for b in req.blocks[hit:]:
            if b in cache:
                continue
            if len(cache) >= capacity_blocks:
                cache.popitem(last=False)
            cache[b] = None
    return hit_tokens / max(1, total)


def belady(trace: list[Request], capacity_blocks: int) -> float:
    """Belady's MIN (with bypass): evict the block used again farthest in the future.

    Ties go to the deeper block. A block's next use is never before its parent's (every request
    that uses a block uses its whole prefix), so MIN keeps the cache prefix-closed and its block
    hits are prefix hits: the optimum for this hit definition.
    """
    never = len(trace)
    nxt: list[list[int]] = [[] for _ in trace]
    last: dict[int, int] = {}
    for j in range(len(trace) - 1, -1, -1):
        nxt[j] = [last.get(b, never) for b in trace[j].blocks]
        for b in trace[j].blocks:
            last[b] = j
    resident: dict[int, tuple[int, int]] = {}  # block -> (next use, depth)
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, block), lazily invalidated
    hit_tokens = total = 0
    for j, req in enumerate(trace):
        total += req.input_tokens
        hit = 0
        for b in req.blocks:
            if b not in resident:
                break
            hit += 1
        hit_tokens += hit * BLOCK_TOKENS
        for depth, (b, n) in enumerate(zip(req.blocks, nxt[j], strict=True)):
            if b in resident:
                resident[b] = (n, depth)
                heapq.heappush(heap, (-n, -depth, b))
                continue
            if n == never:
                continue  # never used again: bypass
            while len(resident) >= capacity_blocks:
                negn, negd, victim = heap[0]
                if resident.get(victim) != (-negn, -negd):
                    heapq.heappop(heap)
                    continue
                if (-negn, -negd) <= (n, depth):
                    break  # everything resident is needed sooner: bypass the new block
                heapq.heappop(heap)
                del resident[victim]
            if len(resident) < capacity_blocks:
                resident[b] = (n, depth)
                heapq.heappush(heap, (-n, -depth, b))
        if len(heap) > 4 * len(resident) + 1024:
            heap = [(-n, -d, b) for b, (n, d) in resident.items()]
            heapq.heapify(heap)
    return hit_tokens / max(1, total)


def l2_admission(trace: list[Request], policy: str, capacity_blocks: int, mode: str) -> tuple[float, int]:
    """(token hit rate of L1 + an unbounded L2, blocks written to L2) under an admission mode:
    `all` writes every stored block, `second-hit` only blocks a lookup hit in L1, `tinylfu` also blocks
    stored before (the server's l2/admission.py, driven the way cache.py drives it)."""
    from kvserver.l2.admission import Admission

    adm = Admission(mode)
    l1 = L1Cache(cast(Arena, _SimArena(capacity_blocks * OBJECT_BYTES)), make_policy(policy))
    l2: set[int] = set()
    l1.on_evict.append(adm.on_evict)
    writes = hit_tokens = total = 0

    def write(keys: list[ObjectKey]) -> int:
        fresh = {int.from_bytes(k[6], "big") for k in keys} - l2
        l2.update(fresh)
        return len(fresh)

    for req in trace:
        total += req.input_tokens
        keys = [_key(b) for b in req.blocks]
        hit = 0
        while hit < len(keys) and l1.ready(keys[hit]) is not None:
            hit += 1
        if hit:
            writes += write(adm.on_hit(keys[:hit]))
        l1.touch_many(keys[:hit][::-1])  # as cache.py's lookup: tail first, one call
        served = hit
        while served < len(keys) and req.blocks[served] in l2:
            served += 1  # loaded from L2 into L1 below, like a prefetch
        hit_tokens += served * BLOCK_TOKENS
        written = _store_missing(l1, keys, req.blocks, hit)
        writes += write(adm.on_commit(written))
    return hit_tokens / max(1, total), writes


def _store_missing(l1: Any, keys: list[Any], blocks: tuple[int, ...], hit: int) -> list[Any]:
    """Store the blocks after the hit the way a real store does (each linked to its parent, stopping
    at the first one that finds no room); returns the keys written."""
    written = []
    for i in range(hit, len(keys)):
        if keys[i] in l1.entries:
            continue
        if l1.reserve(keys[i], OBJECT_BYTES, blocks[i - 1].to_bytes(32, "big") if i else None) is None:
            break
        written.append(keys[i])
    for k in reversed(written):
        l1.finish_write(k)
    return written
