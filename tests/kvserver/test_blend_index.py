"""CacheBlend's content index against a real kvserver: blend_store, blend_lookup, bounds, and isolation
from the exact prefix path."""

from __future__ import annotations

import numpy as np
import pytest

from kvtestkit.kvhelpers import lookup, payload, register, retrieve, store, tiny_layout, sid
from kvprotocol import Client, KeySpace, ServerError, pack_tokens
from kvprotocol.kvsum import kvsum64

C = 256


def docs(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 50_000, int(rng.integers(C, 2 * C + 100))).tolist() for _ in range(n)]


def blend_store(
    c: Client, ks: KeySpace, doc: list[int], data_of, *, pos_base: int = 0, salt: str = "", rank: int = 0
) -> dict:
    reply = c.call(
        "blend_store",
        keyspace=ks.to_wire(),
        tokens=pack_tokens(doc),
        rank=rank,
        salt=salt,
        pos_base=pos_base,
        mode="tcp",
    ).result
    reserved = [s for s in reply["slots"] if s["status"] == "reserved"]
    frames = [data_of(s["chunk"], s["group"]) for s in reserved]
    if reply["store_id"]:
        c.call("commit", frames=frames, store_id=reply["store_id"], checksums=[kvsum64(f) for f in frames])
    return reply


def blend_lookup(c: Client, ks: KeySpace, prompt: list[int], starts: list[int], **kw) -> dict:
    return c.call("blend_lookup", keyspace=ks.to_wire(), tokens=pack_tokens(prompt), starts=starts, **kw).result


def prompt_of(parts: list[list[int]]) -> tuple[list[int], list[int]]:
    tokens: list[int] = []
    starts = []
    for p in parts:
        starts.append(len(tokens))
        tokens += p
    return tokens, starts


def test_matches_at_shuffled_positions_and_retrieve(server):
    with server.client() as c:
        ks, _ = register(c)
        size = tiny_layout().object_bytes
        corpus = docs(4)
        for d, doc in enumerate(corpus):
            reply = blend_store(c, ks, doc, lambda ch, g, d=d: payload(100 * d + ch, size))
            assert [s["ref_pos"] for s in reply["slots"]] == [i * C for i in range(len(doc) // C)]
        system, query = list(range(1, 40)), list(range(40, 77))
        order = [2, 0, 3]  # doc 1 left out, the others shuffled
        tokens, starts = prompt_of([system, *[corpus[i] for i in order], query])
        result = blend_lookup(c, ks, tokens, starts, session=sid("b1"))
        expected = [(starts[1 + k] + i * C, i * C, d) for k, d in enumerate(order) for i in range(len(corpus[d]) // C)]
        assert [(m["start"], m["ref_pos"]) for m in result["matches"]] == [(s, p) for s, p, _ in expected]
        assert result["hit_tokens"] == len(expected) * C
        got = retrieve(c, "b1", 0, len(expected))
        for i, (_, ref, d) in enumerate(expected):
            assert got[(i, 0)] == payload(100 * d + ref // C, size)
        c.call("end_session", session=sid("b1"))
        # the prefix path never sees blend chunks: the same prompt is a prefix miss
        assert lookup(c, ks, tokens) == 0
        described = c.call("describe").result
        assert described["blend"]["hit_chunks"] == len(expected)
        assert described["counters"]["lookup_hit_tokens"] == 0
        assert described["counters"]["stored_objects"] == 0  # blend objects count only under "blend"
        assert described["blend"]["stored_objects"] == sum(len(d) // C for d in corpus)


def test_unknown_docs_salt_and_unaligned_segments_miss(server):
    with server.client() as c:
        ks, _ = register(c)
        size = tiny_layout().object_bytes
        [doc, other] = docs(2, seed=1)
        blend_store(c, ks, doc, lambda ch, g: payload(ch, size), salt="tenant-a")
        tokens, starts = prompt_of([[5] * 30, other, doc])
        assert blend_lookup(c, ks, tokens, starts)["matches"] == []  # different salt namespace
        assert len(blend_lookup(c, ks, tokens, starts, salt="tenant-a")["matches"]) == len(doc) // C
        # the document's start is not given as a segment start: its chunks are not found
        assert blend_lookup(c, ks, tokens, [0], salt="tenant-a")["matches"] == []
        # a changed token in chunk 0 changes the fingerprint of chunk 0 and every later chunk of the doc
        changed = list(doc)
        changed[3] += 1
        tokens2, starts2 = prompt_of([[5] * 30, changed])
        assert blend_lookup(c, ks, tokens2, starts2, salt="tenant-a")["matches"] == []


def test_position_base_is_part_of_identity(server):
    with server.client() as c:
        ks, _ = register(c)
        size = tiny_layout().object_bytes
        [doc] = docs(1, seed=2)
        blend_store(c, ks, doc, lambda ch, g: payload(ch, size), pos_base=0)
        again = blend_store(c, ks, doc, lambda ch, g: payload(50 + ch, size), pos_base=1000)
        assert {s["status"] for s in again["slots"]} == {"reserved"}  # other positions, other bytes
        tokens, starts = prompt_of([[7] * 10, doc])
        result = blend_lookup(c, ks, tokens, starts, session=sid("p"))
        assert [m["ref_pos"] for m in result["matches"]] == [1000 + i * C for i in range(len(doc) // C)]
        assert retrieve(c, "p", 0, 1)[(0, 0)] == payload(50, size)  # the newest copy's bytes
        dup = blend_store(c, ks, doc, lambda ch, g: payload(0, size), pos_base=0)
        assert dup["store_id"] is None and {s["status"] for s in dup["slots"]} == {"present"}


def test_uncommitted_blend_store_is_invisible_and_clear_empties_index(server):
    with server.client() as c:
        ks, _ = register(c)
        [doc] = docs(1, seed=3)
        reply = c.call("blend_store", keyspace=ks.to_wire(), tokens=pack_tokens(doc), rank=0, mode="tcp").result
        tokens, starts = prompt_of([doc])
        assert blend_lookup(c, ks, tokens, starts)["matches"] == []
        c.call("abort", store_id=reply["store_id"])
        blend_store(c, ks, doc, lambda ch, g: payload(ch, tiny_layout().object_bytes))
        assert blend_lookup(c, ks, tokens, starts)["matches"]
        c.call("clear")
        assert blend_lookup(c, ks, tokens, starts)["matches"] == []
        assert c.call("describe").result["blend"]["index_entries"] == 0


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"starts": []}, "BAD_FIELD"),
        ({"starts": [0, 0]}, "BAD_FIELD"),
        ({"starts": [5, 2]}, "BAD_FIELD"),
        ({"starts": [0, 10_000]}, "OUT_OF_RANGE"),
        ({"starts": "0"}, "BAD_FIELD"),
        ({"starts": [-1]}, "OUT_OF_RANGE"),
        ({"starts": [0], "rank": 3}, "OUT_OF_RANGE"),
    ],
)
def test_blend_lookup_bad_input(server, fields, code):
    with server.client() as c:
        ks, _ = register(c)
        with pytest.raises(ServerError) as err:
            c.call("blend_lookup", keyspace=ks.to_wire(), tokens=pack_tokens(list(range(600))), **fields)
        assert err.value.code == code
        assert c.call("ping").result["protocol"]  # still serving


def test_bounds_and_bad_blend_store(server):
    with server.client() as c:
        ks, _ = register(c, world_size=64)
        many = list(range(C * 1100))  # 1100 chunks x 64 objects > MAX_KEYS
        with pytest.raises(ServerError) as err:
            blend_lookup(c, ks, many, [0])
        assert err.value.code == "TOO_LARGE"
        with pytest.raises(ServerError) as err:
            c.call("blend_store", keyspace=ks.to_wire(), tokens=pack_tokens(many[:C]), rank=64)
        assert err.value.code == "OUT_OF_RANGE"
        bad_ks = KeySpace("m", 1, ("0123456789abcdef",))
        with pytest.raises(ServerError) as err:
            c.call("blend_store", keyspace=bad_ks.to_wire(), tokens=pack_tokens(many[:C]), rank=0)
        assert err.value.code == "LAYOUT_MISMATCH"
        with pytest.raises(ServerError) as err:
            c.call("blend_store", keyspace=ks.to_wire(), tokens=pack_tokens(many[:C]), rank=0, pos_base=-1)
        assert err.value.code == "OUT_OF_RANGE"
        assert c.call("describe").result["blend"]["index_entries"] == 0


def test_prefix_store_unaffected_by_blend_corpus(server):
    with server.client() as c:
        ks, _ = register(c)
        size = tiny_layout().object_bytes
        [doc] = docs(1, seed=4)
        blend_store(c, ks, doc, lambda ch, g: payload(ch, size))
        reply = store(c, ks, doc, lambda ch, g: payload(ch + 9, size))
        assert {s["status"] for s in reply["slots"]} == {"reserved"}  # no dedup across the two families
        assert lookup(c, ks, doc, session=sid("x")) == (len(doc) // C) * C
        assert retrieve(c, "x", 0, 1)[(0, 0)] == payload(9, size)


def test_blend_metrics_are_apart_from_prefix_metrics(server_factory):
    import httpx

    from kvtestkit.httpkv import parse_metrics, value

    srv = server_factory("--l1-size-gb", "0.05", http=True)
    with srv.client() as c:
        ks, _ = register(c)
        size = tiny_layout().object_bytes
        [doc] = docs(1, seed=5)
        blend_store(c, ks, doc, lambda ch, g: payload(ch, size))
        tokens, starts = prompt_of([[3] * 17, doc])
        hit = blend_lookup(c, ks, tokens, starts)["hit_tokens"]
        assert hit == (len(doc) // C) * C
        assert lookup(c, ks, tokens) == 0
    samples = parse_metrics(httpx.get(f"{srv.http_url}/metrics", timeout=5).text)
    assert value(samples, "kvserver_blend_hit_tokens_total") == hit
    assert value(samples, "kvserver_blend_lookup_requests_total") == 1
    assert value(samples, "kvserver_blend_store_bytes_total") == (len(doc) // C) * size
    assert value(samples, "kvserver_blend_index_entries") == len(doc) // C
    assert value(samples, "kvserver_lookup_hit_tokens_total") == 0
    assert value(samples, "kvserver_store_bytes_total", tier="l1") == 0


def test_eviction_removes_index_entries(server_factory):
    srv = server_factory("--l1-size-gb", "0.01")
    with srv.client() as c:
        ks, _ = register(c)
        size = tiny_layout().object_bytes
        [doc] = docs(1, seed=6)
        blend_store(c, ks, doc, lambda ch, g: payload(ch, size))
        tokens, starts = prompt_of([[3] * 5, doc])
        assert blend_lookup(c, ks, tokens, starts)["matches"]
        capacity = c.call("describe").result["l1"]["capacity_bytes"]
        for i in range(3):  # prefix stores of more than the whole arena: the blend objects are evicted
            filler = list(range(i * 10**6, i * 10**6 + C * (capacity // size // 2)))
            store(c, ks, filler, lambda ch, g: payload(ch, size))
        described = c.call("describe").result
        assert described["l1"]["evictions"] > 0
        assert blend_lookup(c, ks, tokens, starts)["matches"] == []
        assert described["blend"]["index_entries"] == 0
