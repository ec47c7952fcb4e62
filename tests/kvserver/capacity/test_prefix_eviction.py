"""Prefix-aware eviction in a real server, for every policy: whole chunks, tails first, and a store
never evicts the prefix it extends."""

from __future__ import annotations

import pytest

from kvtestkit.kvhelpers import lookup, payload, register, store, tiny_layout
from kvprotocol import pack_tokens

POLICIES = ["lru", "lfu", "arc", "s3fifo", "lhd"]
LAYOUT = tiny_layout(layers=32, block_bytes=4096)  # 1 MiB objects
ARENA = ["--l1-size-gb", str(8 / 1024)]  # 8 objects


def tokens(i: int, chunks: int) -> list[int]:
    return [i * 100_000 + t for t in range(256 * chunks)]


def fill(c, ks, toks, *, rank=0, start_chunk=0):
    return store(
        c, ks, toks, lambda ch, g: payload(ch * 7 + g, LAYOUT.object_bytes), rank=rank, start_chunk=start_chunk
    )


def per_chunk(c, ks, toks):
    q = c.call("query", keyspace=ks.to_wire(), tokens=pack_tokens(toks)).result
    return [ch["l1"] for ch in q["chunks"]], q["chunks"][0]["objects"]


@pytest.mark.parametrize("policy", POLICIES)
def test_prefixes_shrink_from_the_tail(server_factory, policy):
    srv = server_factory(*ARENA, "--eviction-policy", policy)
    with srv.client() as c:
        ks, _ = register(c, layouts=[LAYOUT])
        a = tokens(1, 6)
        fill(c, ks, a)  # six chunks, the oldest objects in the cache
        for i in range(2, 12):
            fill(c, ks, tokens(i, 1))  # one-chunk prompts push the arena over
            present, _ = per_chunk(c, ks, a)
            k = present.index(0) if 0 in present else len(present)
            assert present == [1] * k + [0] * (len(present) - k), present  # never a hole before the tail
        assert lookup(c, ks, a) < 6 * 256  # something of it was evicted after all


@pytest.mark.parametrize("policy", POLICIES)
def test_a_chunks_objects_live_and_die_together(server_factory, policy):
    """Two ranks x two groups: a chunk is four objects; eviction never leaves a chunk partly resident."""
    srv = server_factory("--l1-size-gb", str(10 / 1024), "--eviction-policy", policy)  # 2.5 chunks
    layouts = [LAYOUT, tiny_layout(layers=32, block_bytes=4096, dtype="bfloat16")]
    with srv.client() as c:
        ks, _ = register(c, layouts=layouts, world_size=2)
        register(c, layouts=layouts, world_size=2, rank=1)
        prompts = [tokens(i, 1) for i in range(8)]
        for toks in prompts:
            for rank in (0, 1):
                fill(c, ks, toks, rank=rank)
        assert c.call("describe").result["l1"]["evictions"] > 0
        for toks in prompts:
            present, objects = per_chunk(c, ks, toks)
            assert objects == 4 and present[0] in (0, 4), present


@pytest.mark.parametrize("policy", POLICIES)
def test_a_store_never_evicts_the_prefix_it_extends(server_factory, policy):
    srv = server_factory(*ARENA, "--eviction-policy", policy)
    with srv.client() as c:
        ks, _ = register(c, layouts=[LAYOUT])
        conv = tokens(1, 8)
        fill(c, ks, conv[: 4 * 256])  # turn 1: four chunks, then they go cold
        assert lookup(c, ks, conv) == 4 * 256
        for i in range(2, 6):
            fill(c, ks, tokens(i, 1))
            for _ in range(3):
                lookup(c, ks, tokens(i, 1))  # hot and recent: every policy prefers to keep these
        reply = fill(c, ks, conv, start_chunk=4)  # turn 2 extends turn 1 by four chunks: must evict
        assert [s["status"] for s in reply["slots"]] == ["reserved"] * 4
        assert lookup(c, ks, conv) == 8 * 256  # the whole conversation, its head included
