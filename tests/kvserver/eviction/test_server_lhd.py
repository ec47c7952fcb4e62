"""lhd in a real server: after traffic where conversations come back and one-off prompts never do,
a conversation that was read again outlives newer one-off prompts; LRU gives it up first."""

from __future__ import annotations

import random

import pytest

from kvtestkit.kvhelpers import lookup, payload, register, store, tiny_layout

LAYOUT = tiny_layout()  # 16 KiB objects
SLOTS = 64
CHUNK = 256


def tokens(chunk_ids: list[int]) -> list[int]:
    return [c * CHUNK + t for c in chunk_ids for t in range(CHUNK)]


def put(c, ks, chunk_ids: list[int], start: int = 0) -> None:
    store(c, ks, tokens(chunk_ids), lambda ch, g: payload(ch, LAYOUT.object_bytes), start_chunk=start)


def traffic(c, ks, rounds: int, rng: random.Random, fresh) -> None:
    """Engines at work: one-off prompts of two chunks, and conversations whose recent ones come back,
    read whole and extended by a chunk (a conversation that lost its cache is stored again)."""
    live: list[list[int]] = []
    for _ in range(rounds):
        if live and rng.random() < 0.3:
            conv = live.pop(rng.randrange(max(0, len(live) - 16), len(live)))
            conv.append(fresh())
            hit = lookup(c, ks, tokens(conv)) // CHUNK
            put(c, ks, conv, start=hit)
            live.append(conv)
        else:
            put(c, ks, [fresh(), fresh()])
        if rng.random() < 0.2:
            live.append([fresh()])
            put(c, ks, live[-1])


@pytest.mark.parametrize("policy", ["lhd", "lru"])
def test_a_conversation_read_again_outlives_newer_one_off_prompts(server_factory, policy):
    srv = server_factory("--l1-size-gb", repr(SLOTS * LAYOUT.object_bytes / (1 << 30)), "--eviction-policy", policy)
    ids = iter(range(1, 1 << 20))
    fresh = lambda: next(ids)  # noqa: E731
    with srv.client() as c:
        ks, _ = register(c, layouts=[LAYOUT])
        assert c.call("describe").result["l1"]["capacity_bytes"] // LAYOUT.object_bytes == SLOTS
        traffic(c, ks, 4000, random.Random(7), fresh)  # ~11k inserts and reads: lhd's estimate refreshed twice
        x = [fresh(), fresh()]
        put(c, ks, x)  # a conversation's first turn...
        assert lookup(c, ks, tokens(x)) == 2 * CHUNK  # ...read again
        for _ in range(SLOTS):  # then as many one-off prompts as L1 holds: LRU must have let it go
            put(c, ks, [fresh()])
        kept = lookup(c, ks, tokens(x)) == 2 * CHUNK
        assert c.call("describe").result["l1"]["evictions"] > 0
    assert kept == (policy == "lhd")  # LRU: the oldest goes, whatever it was
