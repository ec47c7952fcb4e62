"""Two-tier trace simulation: L1 (the server's L1Cache and policy) over a bounded L2 (the server's
L2Directory and its policy, with the server's demotion rule), replayed over a Mooncake-format trace.

Why: the tiers are meant to behave as one cache, so the question is how close L1 + L2 at sizes
(a, b) gets to one cache of a + b blocks. The replay does what the server does: a lookup that misses in L1
loads into L1 the longest prefix L1 and L2 hold together (as l2/prefetch.py: L1's part leased, slots
reserved and made ready in order, the chain linked), answers with L1's prefix after that (touching
it tail first), and the engine stores the rest in L1; an object
L1 evicts is written to L2 only if L2 does not hold it and the demotion rule admits it; L2 evicts
by its policy, tail first. Hits in either tier are reported to L2's policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from kvprotocol import ObjectKey

from kvserver.l1.arena import Arena
from kvserver.l1.cache import L1Cache
from kvserver.l1.eviction import make_policy
from kvserver.l2.demotion import Demotion
from kvserver.l2.directory import L2Directory
from kvtestkit.tracesim import BLOCK_TOKENS, OBJECT_BYTES, Request, _key, _SimArena, _store_missing, block_of


@dataclass(frozen=True, slots=True)
class TierResult:
    hit_rate: float  # token hit rate of both tiers together
    l1_hit_rate: float  # the part served from L1
    l2_writes: int  # objects written to L2
    free_drops: int  # objects L1 evicted that L2 already held (no write)
    l2_evictions: int


def two_tier(
    trace: list[Request],
    l1_policy: str,
    l1_blocks: int,
    l2_blocks: int,
    l2_policy: str = "lru",
    demotion: str = "evicted",
) -> TierResult:
    """Replay `trace` through L1 (`l1_blocks`) over L2 (`l2_blocks`); see the module docstring."""
    l1 = L1Cache(cast(Arena, _SimArena(l1_blocks * OBJECT_BYTES)), make_policy(l1_policy))
    l2: L2Directory[int] = L2Directory(make_policy(l2_policy), l2_blocks * OBJECT_BYTES)
    rule = Demotion(demotion)
    parent: dict[int, int] = {}
    writes = drops = 0

    def evicted(key: ObjectKey) -> None:
        nonlocal writes, drops
        block = block_of(key)
        if l2.settle(block):
            drops += 1
        elif rule.admit(key):
            writes += l2.admit(block, OBJECT_BYTES, parent.get(block))[0]
        rule.forget(key)

    l1.on_evict.append(evicted)
    hit_tokens = l1_tokens = total = 0
    for req in trace:
        total += req.input_tokens
        keys = [_key(b) for b in req.blocks]
        for i in range(1, len(req.blocks)):
            parent.setdefault(req.blocks[i], req.blocks[i - 1])
        hit = l1_hit = _l1_prefix(l1, keys)
        if hit < len(keys):
            hit = _prefetch(l1, l2, keys, req.blocks, hit)
        l1.touch_many(keys[:hit][::-1])  # the lookup's answer, after the load: tail first
        rule.hit(keys[:hit])
        l2.hit(req.blocks[:hit][::-1])
        hit_tokens += hit * BLOCK_TOKENS
        l1_tokens += l1_hit * BLOCK_TOKENS
        _store_missing(l1, keys, req.blocks, hit)  # the engine computes and stores the rest
    return TierResult(hit_tokens / max(1, total), l1_tokens / max(1, total), writes, drops, l2.evicted)


def _l1_prefix(l1: L1Cache, keys: list[ObjectKey]) -> int:
    hit = 0
    while hit < len(keys) and l1.ready(keys[hit]) is not None:
        hit += 1
    return hit


def _prefetch(l1: L1Cache, l2: L2Directory[int], keys: list[ObjectKey], blocks: tuple[int, ...], hit: int) -> int:
    """What the server's prefetch does after an L1 miss: load into L1 the run of chunks L1 and L2
    cover together (L1's part leased meanwhile, slots reserved in order without a parent, made ready
    in order, then the chain linked); returns the L1 prefix after it."""
    end = hit
    while end < len(keys) and (blocks[end] in l2 or l1.ready(keys[end]) is not None):
        end += 1
    if end == hit:
        return hit
    protected = [k for k in keys[:end] if l1.ready(k) is not None]
    for k in protected:
        l1.lease(k)
    loaded = []
    for k in keys[hit:end]:
        if k in l1.entries:
            continue
        if l1.reserve(k, OBJECT_BYTES) is None:
            break
        loaded.append(k)
    for k in loaded:
        l1.finish_write(k)
    for k in protected:
        l1.unlease(k)
    l2.promote([block_of(k) for k in loaded])
    l1.link_chain("trace", 1, "", [b.to_bytes(32, "big") for b in blocks])
    return _l1_prefix(l1, keys)
