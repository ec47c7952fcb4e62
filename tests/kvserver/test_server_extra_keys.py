"""Per-chunk extra keys on a real server: they separate objects, and malformed ones change nothing."""

from __future__ import annotations

import pytest
from blake3 import blake3

from kvtestkit.kvhelpers import lookup, payload, register, retrieve, sid
from kvprotocol import ServerError, chunk_hashes, pack_tokens
from kvprotocol.kvsum import kvsum64

TOKENS = list(range(100, 100 + 800))  # 3 full chunks of 256
A, B = blake3(b"adapter-a").digest(), blake3(b"adapter-b").digest()
SIZE = 2 * 8 * 1024  # tiny_layout: 2 layers x 8 blocks x 1024 bytes per chunk


def _store(c, ks, extra, seed):
    reply = c.call("store", keyspace=ks.to_wire(), tokens=pack_tokens(TOKENS), rank=0, mode="tcp", extra=extra).result
    reserved = [s for s in reply["slots"] if s["status"] == "reserved"]
    frames = [payload(seed + s["chunk"], s["size"]) for s in reserved]
    c.call("commit", frames=frames, store_id=reply["store_id"], checksums=[kvsum64(f) for f in frames])
    return reply


def _hit(c, ks, extra, session=None):
    fields = {"keyspace": ks.to_wire(), "tokens": pack_tokens(TOKENS), "extra": extra}
    if session:
        fields["session"] = sid(session)
    return c.call("lookup", **fields).result["hit_tokens"]


def test_extra_keys_separate_objects_and_match_the_client_hash(server):
    with server.client() as c:
        ks, _ = register(c)
        _store(c, ks, [[0, A], [2, A]], seed=1)
        assert _hit(c, ks, [[0, A], [2, A]]) == 768
        assert _hit(c, ks, [[0, B], [2, B]]) == 0  # another adapter: nothing shared
        assert _hit(c, ks, []) == 0 and lookup(c, ks, TOKENS) == 0  # a plain request shares nothing
        assert _hit(c, ks, [[0, A]]) == 512  # chunk 2 without its extra key is another object
        q = c.call("query", keyspace=ks.to_wire(), tokens=pack_tokens(TOKENS), extra=[[0, A], [2, A]]).result
        assert [ch["hash"] for ch in q["chunks"]] == [h.hex() for h in chunk_hashes(TOKENS, 256, [(0, A), (2, A)])]
        assert q["prefix_tokens"] == 768
        _hit(c, ks, [[0, A], [2, A]], session=sid("s1"))
        got = retrieve(c, "s1", 0, 3)
        assert got[(2, 0)] == payload(1 + 2, SIZE)
        pinned = c.call("pin", keyspace=ks.to_wire(), tokens=pack_tokens(TOKENS), extra=[[0, A], [2, A]]).result
        assert pinned["objects"] == 3


@pytest.mark.parametrize("op", ["lookup", "query", "store", "pin", "unpin"])
@pytest.mark.parametrize(
    "extra,code",
    [
        ([[3, A]], "OUT_OF_RANGE"),  # 800 tokens hold chunks 0..2 only
        ([[1, A], [1, B]], "BAD_FIELD"),
        ([[0, A[:16]]], "BAD_FIELD"),
        ([["0", A]], "BAD_FIELD"),
        ({"0": A}, "BAD_FIELD"),
    ],
)
def test_malformed_extra_is_refused_and_changes_nothing(server, op, extra, code):
    with server.client() as c:
        ks, _ = register(c)
        _store(c, ks, [[0, A]], seed=5)
        before = c.call("describe").result["counters"]
        fields = {"keyspace": ks.to_wire(), "tokens": pack_tokens(TOKENS), "extra": extra}
        if op == "store":
            fields.update(rank=0, mode="tcp")
        if op == "lookup":
            fields["session"] = sid("s-bad")
        with pytest.raises(ServerError) as info:
            c.call(op, **fields)
        assert info.value.code == code
        after = c.call("describe").result["counters"]
        assert after == before
        assert _hit(c, ks, [[0, A]]) == 768  # the server keeps serving what it held
        with pytest.raises(ServerError) as info:
            c.call("retrieve", session=sid("s-bad"), rank=0, start_chunk=0, end_chunk=1)
        assert info.value.code == "UNKNOWN_SESSION"  # the refused lookup opened no session
