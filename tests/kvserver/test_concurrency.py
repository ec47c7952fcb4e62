"""Many clients at once: the same keys stored concurrently end up stored once, with one writer's bytes."""

from __future__ import annotations

import asyncio

from kvtestkit.kvhelpers import lookup, payload, register, tiny_layout, sid
from kvprotocol import AsyncClient, pack_tokens
from kvprotocol.kvsum import kvsum64

TOKENS = list(range(256 * 6))


async def _store(url, ks, who):
    size = tiny_layout().object_bytes
    async with AsyncClient(url) as c:
        reply = (await c.call("store", keyspace=ks.to_wire(), tokens=pack_tokens(TOKENS), rank=0, mode="tcp")).result
        reserved = [s for s in reply["slots"] if s["status"] == "reserved"]
        await asyncio.sleep(0.05)  # both writers hold reservations at the same time
        if reserved:
            frames = [payload(who * 100 + s["chunk"], size) for s in reserved]
            await c.call("commit", frames=frames, store_id=reply["store_id"], checksums=[kvsum64(f) for f in frames])
        return reply["slots"]


def test_two_clients_store_the_same_keys(server):
    with server.client() as c:
        ks, _ = register(c)

    async def both():
        return await asyncio.gather(_store(server.url, ks, 1), _store(server.url, ks, 2))

    a, b = asyncio.run(both())
    statuses = sorted((s["status"], t["status"]) for s, t in zip(a, b))
    # each chunk reserved by exactly one writer, seen as in-flight by the other
    assert all(sorted(pair) == ["reserved", "writing"] for pair in statuses)
    with server.client() as c:
        assert lookup(c, ks, TOKENS, session=sid("check")) == len(TOKENS)
        reply = c.call("retrieve", session=sid("check"), rank=0, start_chunk=0, end_chunk=6, mode="tcp")
        size = tiny_layout().object_bytes
        for obj, frame in zip(reply.result["objects"], reply.frames):
            writer = 1 if a[obj["chunk"]]["status"] == "reserved" else 2
            assert bytes(frame) == payload(writer * 100 + obj["chunk"], size)
        assert c.call("describe").result["l1"]["objects"] == 6


def test_many_requests_in_flight_on_one_async_client(server):
    with server.client() as c:
        ks, _ = register(c)

    async def run():
        async with AsyncClient(server.url) as c:
            calls = [
                c.call("lookup", keyspace=ks.to_wire(), tokens=pack_tokens(TOKENS[: 256 * (i % 6 + 1)]))
                for i in range(200)
            ]
            return await asyncio.gather(*calls)

    replies = asyncio.run(run())
    assert [r.result["num_chunks"] for r in replies] == [i % 6 + 1 for i in range(200)]
