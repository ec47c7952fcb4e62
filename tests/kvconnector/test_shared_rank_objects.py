"""MLA: every tensor-parallel rank holds the same latent cache, so a `shared` group keeps ONE object
per chunk for all ranks (kv_rank = SHARED_RANK), not one per rank. Two EngineClients as ranks 0 and
1 of one engine store and load through a real kvserver: the second rank's store finds the objects
present, the server holds one object per chunk (memory / TP degree), and both ranks load the same
bytes. A non-shared MLA layout keeps one object per rank, as before."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine_kv_helpers import SENTINEL, Geometry, module_server
from kvconnector.engine_client import EngineClient
from kvtestkit.kvhelpers import register as plain_register, sid
from kvprotocol import SHARED_RANK, Client, KeySpace, ObjectKey, ServerError, ValidationError, pack_tokens
from kvprotocol import requests as rq

server = module_server("--chunk-size", "64")
GEO = Geometry("mla", chunk_size=64, block_size=16)
CHUNKS = 3
NB = CHUNKS * 64 // 16  # blocks [0, NB) are saved from, [NB, 2 NB) loaded into


def _query(url: str, layout, tokens: list[int]) -> list[dict]:
    with Client(url) as c:
        ks = KeySpace.from_layouts("mla/m", 2, [layout])
        return [dict(ch) for ch in c.call("query", keyspace=ks.to_wire(), tokens=pack_tokens(tokens)).result["chunks"]]


@pytest.mark.parametrize("mode", ["shm", "tcp"])
def test_two_ranks_share_one_object_per_chunk(server, mode: str) -> None:
    layout = GEO.layout()
    layout = replace(layout, shared=True)
    tokens = list(range(1000, 1000 + CHUNKS * 64 + 5)) if mode == "shm" else list(range(3000, 3000 + CHUNKS * 64))
    kv = GEO.random_kv(2 * NB, seed=7)
    for layer in kv:
        layer[NB:] = SENTINEL
    ranks = [EngineClient(server.url, "mla/m", 2, r, [layout], mode=mode, timeout=10) for r in (0, 1)]
    kvs = [kv, [t.clone() for t in kv]]  # both ranks hold the same latent cache
    try:
        for c, k in zip(ranks, kvs):
            assert c.register(k)
        first = ranks[0].save(tokens, list(range(NB)))
        assert first.ok and first.saved_chunks == CHUNKS
        second = ranks[1].save(tokens, list(range(NB)))
        assert second.ok and second.saved_chunks == 0 and second.cached_chunks == CHUNKS  # already there
        # one object per chunk on the server, whatever the TP degree
        assert [ch["objects"] for ch in _query(server.url, layout, tokens)] == [1] * CHUNKS
        assert [ch["l1"] for ch in _query(server.url, layout, tokens)] == [1] * CHUNKS
        sched = EngineClient(server.url, "mla/m", 2, 0, [layout], mode=mode, timeout=10)
        assert sched.lookup(tokens, session=sid(f"s-{mode}")).hit_tokens == CHUNKS * 64
        for c, k in zip(ranks, kvs):
            res = c.load(sid(f"s-{mode}"), tokens, list(range(NB, 2 * NB)), 0, CHUNKS * 64)
            assert res.ok, res.error
            for layer in k:
                assert torch.equal(layer[NB:], layer[:NB])
        sched.close()
    finally:
        for c in ranks:
            c.close()


def test_shared_key_is_the_rank_sentinel_and_unshared_stays_per_rank(server) -> None:
    shared = ObjectKey("m", "0123456789abcdef", 4, SHARED_RANK, 0, "", b"\0" * 32)
    assert "/w4rs/" in shared.to_str()
    plain = GEO.layout()
    assert replace(plain, shared=True).fingerprint != plain.fingerprint  # never the same objects
    with Client(server.url) as c:
        plain_register(c, "mla/m", [plain])
    tokens = list(range(5000, 5000 + 2 * 64))
    kv = GEO.random_kv(NB, seed=3)
    with (
        EngineClient(server.url, "mla/m", 2, 0, [plain], mode="tcp", timeout=10) as r0,
        EngineClient(server.url, "mla/m", 2, 1, [plain], mode="tcp", timeout=10) as r1,
    ):
        assert r0.register(kv) and r1.register(kv)
        assert r0.save(tokens, list(range(NB))).saved_chunks == 2
        assert r1.save(tokens, list(range(NB))).saved_chunks == 2  # its own objects
        assert [ch["objects"] for ch in _query(server.url, plain, tokens)] == [2, 2]


def test_bad_rank_values_are_refused(server) -> None:
    with pytest.raises(ValidationError):
        ObjectKey("m", "0123456789abcdef", 2, -2, 0, "", b"\0" * 32).validate()
    with Client(server.url) as c:  # a client never names the sentinel: only the server's geometry does
        ks = KeySpace.from_layouts("mla/m", 2, [GEO.layout()])
        with pytest.raises(ServerError, match="OUT_OF_RANGE"):
            c.send(
                rq.Lookup(keyspace=ks.wire(), tokens=pack_tokens([1] * 64), salt="", rank=SHARED_RANK, session=sid("x"))
            )
