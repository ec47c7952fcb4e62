"""Tails: the KV of a partial last chunk, stored (Store.tail) and found by a lookup with `tails`,
through a real kvserver."""

from __future__ import annotations

import pytest

from kvtestkit.kvhelpers import ArenaMap, lookup, payload, register, retrieve, store, tiny_layout, sid
from kvprotocol import Client, ErrorCode, ServerError, ValidationError, chunk_hashes, pack_tokens, tail_hash
from kvtestkit.tenants import add_tenant
import kvprotocol._requests as rq

C = 256
TOKENS = list(range(1000, 1000 + C * 4 + 100))  # four full chunks and a tail of 100
SIZE = tiny_layout().object_bytes


def _data(ch: int, g: int) -> bytes:
    return payload(ch * 10 + g, SIZE)


def _next_turn(tokens: list[int], extra: int = 300) -> list[int]:
    return tokens + list(range(7000, 7000 + extra))


@pytest.mark.parametrize("mode", ["tcp", "shm"])
def test_a_stored_tail_extends_the_next_prompts_hit_to_the_token(server, mode):
    with server.client() as c:
        ks, reg = register(c)
        assert reg["tails"] is True
        arena = ArenaMap(reg["arena"]["name"], reg["arena"]["size"]) if mode == "shm" else None
        reply = store(c, ks, TOKENS, _data, mode=mode, arena=arena, tail=True)
        assert [s["chunk"] for s in reply["slots"]] == [0, 1, 2, 3, 4]  # the tail is chunk 4
        turn = _next_turn(TOKENS)
        assert lookup(c, ks, turn) == 4 * C  # a client that does not ask for tails: full chunks only
        got = c.call("lookup", keyspace=ks.to_wire(), tokens=pack_tokens(turn), tails=True, session=sid("t")).result
        assert (got["hit_tokens"], got["hit_chunks"]) == (4 * C + 100, 5)
        assert retrieve(c, "t", 0, 5, mode=mode, arena=arena) == {(ch, 0): _data(ch, 0) for ch in range(5)}
        c.call("end_session", session=sid("t"))
        # the prompt itself (the tail reaches its end), and one that stops inside the tail
        assert lookup(c, ks, TOKENS, tails=True) == 4 * C + 100
        assert lookup(c, ks, TOKENS[: 4 * C + 99], tails=True) == 4 * C
        counters = c.call("describe").result["counters"]
        assert counters["stored_tails"] == 1 and counters["lookup_tail_hits"] == 2


def test_a_tail_is_found_only_under_the_same_tokens_chunks_and_salt(server):
    with server.client() as c:
        ks, _ = register(c)
        store(c, ks, TOKENS, _data, tail=True)
        changed = _next_turn(TOKENS)
        changed[4 * C + 50] += 1  # inside the tail: another tail
        assert lookup(c, ks, changed, tails=True) == 4 * C
        earlier = _next_turn(TOKENS)
        earlier[10] += 1  # before it: another prefix altogether
        assert lookup(c, ks, earlier, tails=True) == 0
        assert lookup(c, ks, _next_turn(TOKENS), salt="other", tails=True) == 0
        # a shorter tail after the same chunk: the longest one the tokens match wins
        store(c, ks, TOKENS[: 4 * C + 40], _data, tail=True)
        assert lookup(c, ks, _next_turn(TOKENS), tails=True) == 4 * C + 100
        assert lookup(c, ks, changed, tails=True) == 4 * C + 40
        # a tail at chunk 0 (a prompt shorter than a chunk)
        short = list(range(9000, 9000 + 70))
        store(c, ks, short, _data, tail=True)
        assert lookup(c, ks, short + [1, 2, 3], tails=True) == 70


def test_a_tail_needs_its_full_chunks_and_a_store_without_one_changes_nothing(server):
    with server.client() as c:
        ks, _ = register(c)
        orphan = store(c, ks, TOKENS, _data, start_chunk=4, tail=True)  # the tail alone, chunk 3 absent
        assert orphan["slots"] == []  # nothing could ever reach it: not stored
        assert lookup(c, ks, _next_turn(TOKENS), tails=True) == 0
        store(c, ks, TOKENS, _data, tail=True)
        assert lookup(c, ks, _next_turn(TOKENS), tails=True) == 4 * C + 100
        aligned = list(range(20000, 20000 + 2 * C))
        reply = store(c, ks, aligned, _data, tail=True)  # ends on a boundary: no tail, no error
        assert [s["chunk"] for s in reply["slots"]] == [0, 1]
        assert c.call("describe").result["counters"]["stored_tails"] == 1  # neither the orphan nor the aligned
        store(c, ks, TOKENS[: 4 * C + 30], _data, start_chunk=4, tail=True)  # alone, after a chunk in L1: stored
        assert lookup(c, ks, TOKENS[: 4 * C + 30] + [1], tails=True) == 4 * C + 30


def test_a_tail_takes_no_extra_keys_and_no_reservation():
    with pytest.raises(ValidationError) as e:
        rq.Store(
            keyspace=rq.KeySpaceW("m", 1, ["0" * 16]),
            tokens=pack_tokens(TOKENS),
            rank=0,
            tail=True,
            extra=[(0, b"x" * 32)],
        )
    assert e.value.code == ErrorCode.BAD_FIELD
    with pytest.raises(ValidationError):
        rq.Store(
            keyspace=rq.KeySpaceW("m", 1, ["0" * 16]),
            tokens=pack_tokens(TOKENS),
            rank=0,
            tail=True,
            reservation=sid("r"),
            total_chunks=5,
        )


def test_the_tail_hash_is_apart_from_every_chunk_hash():
    full = chunk_hashes(pack_tokens(TOKENS), C)
    assert tail_hash(TOKENS[4 * C :], full[3]) not in full
    # same tokens, another length or another chunk before it: another tail
    assert tail_hash(TOKENS[4 * C : 4 * C + 99], full[3]) != tail_hash(TOKENS[4 * C :], full[3])
    assert tail_hash(TOKENS[4 * C :], full[2]) != tail_hash(TOKENS[4 * C :], full[3])
    # a tail of a whole chunk's tokens is still not that chunk
    assert tail_hash(TOKENS[3 * C : 4 * C], full[2]) != full[3]


def test_a_tenant_never_finds_another_tenants_tail(server_factory, tmp_path):
    tenants = tmp_path / "tenants.json"
    tokens = {name: add_tenant(tenants, name) for name in ("alice", "bob")}
    srv = server_factory("--l1-size-gb", "0.05", "--tenants-file", str(tenants))
    with Client(srv.url, token=tokens["alice"]) as a, Client(srv.url, token=tokens["bob"]) as b:
        ks, _ = register(a)
        register(b)
        store(a, ks, TOKENS, _data, tail=True)
        turn = _next_turn(TOKENS)
        assert lookup(a, ks, turn, tails=True) == 4 * C + 100
        assert lookup(b, ks, turn, tails=True) == 0
        store(b, ks, TOKENS[: 4 * C], _data)  # bob's own full chunks: alice's tail still not his
        assert lookup(b, ks, turn, tails=True, session="bob") == 4 * C
        with pytest.raises(ServerError):
            retrieve(b, "bob", 0, 5)
