"""Eviction inside a real server: order per policy, leased objects protected, 'no space' when stuck."""

from __future__ import annotations

import pytest

from kvtestkit.kvhelpers import lookup, payload, register, store, tiny_layout, sid
from kvprotocol import pack_tokens

# 1 MiB objects (32 layers x 8 blocks x 4 KiB) in an arena of 8 MiB: 8 slots
LAYOUT = tiny_layout(layers=32, block_bytes=4096)
ARENA = ["--l1-size-gb", str(8 / 1024)]


def prompt(i: int) -> list[int]:
    return [i * 1000 + t for t in range(256)]  # one chunk per prompt


def fill(c, ks, ids):
    for i in ids:
        store(c, ks, prompt(i), lambda ch, g: payload(ch, LAYOUT.object_bytes))


def present(c, ks, ids):
    return [i for i in ids if lookup(c, ks, prompt(i)) == 256]


@pytest.mark.parametrize("policy", ["lru", "lfu", "arc", "s3fifo", "lhd"])
def test_eviction_order_in_server(server_factory, policy):
    """0 and 1 are hit again (recent and frequent); 2 and 3 are the oldest one-hit objects."""
    srv = server_factory(*ARENA, "--eviction-policy", policy)
    with srv.client() as c:
        ks, _ = register(c, layouts=[LAYOUT])
        fill(c, ks, range(8))
        for i in (0, 1):
            for _ in range(3):
                lookup(c, ks, prompt(i))  # touched: recent and frequent
        fill(c, ks, [8, 9])
        assert present(c, ks, range(10)) == [0, 1, 4, 5, 6, 7, 8, 9]
        assert c.call("describe").result["l1"]["evictions"] == 2


@pytest.mark.parametrize("policy", ["lru", "lfu", "arc", "s3fifo", "lhd"])
def test_leased_objects_are_never_evicted(server_factory, policy):
    srv = server_factory(*ARENA, "--eviction-policy", policy)
    with srv.client() as c:
        ks, _ = register(c, layouts=[LAYOUT])
        fill(c, ks, range(8))
        for i in range(4):
            assert lookup(c, ks, prompt(i), session=sid(f"hold-{i}")) == 256
        fill(c, ks, range(8, 12))  # forces four evictions
        assert set(present(c, ks, range(4))) == {0, 1, 2, 3}
        assert set(present(c, ks, range(8, 12))) == {8, 9, 10, 11}
        # every slot now leased or newest: lease all eight, a further store gets no space
        for i in range(8, 12):
            lookup(c, ks, prompt(i), session=sid(f"hold-{i}"))
        reply = store(c, ks, prompt(50), lambda ch, g: payload(ch, LAYOUT.object_bytes))
        assert [s["status"] for s in reply["slots"]] == ["no_space"]
        assert reply["store_id"] is None
        c.call("end_session", session=sid("hold-0"))
        reply = store(c, ks, prompt(50), lambda ch, g: payload(ch, LAYOUT.object_bytes))
        assert [s["status"] for s in reply["slots"]] == ["reserved"]
        assert present(c, ks, [0, 50]) == [50]


def test_pinned_objects_survive_and_clear_spares_leases(server_factory):
    srv = server_factory(*ARENA)
    with srv.client() as c:
        ks, _ = register(c, layouts=[LAYOUT])
        fill(c, ks, range(8))
        c.call("pin", keyspace=ks.to_wire(), tokens=pack_tokens(prompt(0)))
        fill(c, ks, range(8, 16))
        assert 0 in present(c, ks, range(16))
        lookup(c, ks, prompt(15), session=sid("keep"))
        removed = c.call("clear").result["removed"]
        assert removed == 7
        assert present(c, ks, range(16)) == [15]


def test_requests_in_one_burst_see_the_touches_of_those_before_them(server_factory):
    """A lookup's touches run after its reply (service/after_reply.py), yet before the server reads the next
    request: a store sent right behind lookups, in the same burst, evicts what they did not touch."""
    import asyncio

    from kvprotocol import AsyncClient

    srv = server_factory(*ARENA, "--eviction-policy", "lru")
    with srv.client() as c:
        ks, _ = register(c, layouts=[LAYOUT])
        fill(c, ks, range(8))  # 0 is the least recently used

    async def burst() -> list[dict]:
        async with AsyncClient(srv.url, token=srv.token, server_key=srv.server_key) as ac:
            calls = [ac.call("lookup", keyspace=ks.to_wire(), tokens=pack_tokens(prompt(i))) for i in (0, 1)]
            calls.append(ac.call("store", keyspace=ks.to_wire(), tokens=pack_tokens(prompt(8)), rank=0, mode="tcp"))
            return [r.result for r in await asyncio.gather(*calls)]

    hits0, hits1, reply = asyncio.run(burst())
    assert hits0["hit_tokens"] == hits1["hit_tokens"] == 256
    assert [s["status"] for s in reply["slots"]] == ["reserved"]
    with srv.client() as c:
        c.call("abort", store_id=reply["store_id"])
        assert present(c, ks, range(8)) == [0, 1, 3, 4, 5, 6, 7]  # 2 went: 0 and 1 had just been read
