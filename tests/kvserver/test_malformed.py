"""Hostile and malformed requests: each gets an error reply with a code, and nothing stored is harmed."""

from __future__ import annotations

import secrets

import msgpack
import pytest
import zmq

from kvtestkit.kvhelpers import lookup, payload, register, retrieve, sid, store, tiny_layout
from kvprotocol import MAX_TOKENS, PROTOCOL_VERSION, ErrorCode, ServerError, resolve_token

TOKENS = list(range(777, 777 + 512))
GOOD_KS = None  # filled by the fixture
AUTH = ""  # the server's token (from its default file), filled by the fixture


def req(op, **fields):
    """An authenticated raw request: these cases test validation, not authentication."""
    return msgpack.packb({"v": PROTOCOL_VERSION, "id": 42, "op": op, "auth": AUTH, **fields}, use_bin_type=True)


def ks_wire(**over):
    d = dict(GOOD_KS.to_wire())
    d.update(over)
    return d


TOK = (b"\x01\x00\x00\x00") * 300
LAYOUT_BAD_CHUNK = {**tiny_layout(chunk_size=128).to_wire()}
LAYOUT_NEG = {**tiny_layout().to_wire(), "block_bytes": -5}

CASES = [
    ("garbage bytes", lambda: [b"\xc1\xff\x00garbage"], "BAD_FRAME"),
    ("empty header", lambda: [b""], "BAD_FRAME"),
    ("a list, not a map", lambda: [msgpack.packb([1, 2, 3])], "BAD_FRAME"),
    ("a bare integer", lambda: [msgpack.packb(7)], "BAD_FRAME"),
    ("int map keys", lambda: [msgpack.packb({1: 2})], "BAD_FRAME"),
    ("missing version", lambda: [msgpack.packb({"id": 1, "op": "ping"})], "BAD_VERSION"),
    ("wrong version", lambda: [msgpack.packb({"v": 99, "id": 1, "op": "ping"})], "BAD_VERSION"),
    ("version as string", lambda: [msgpack.packb({"v": "1", "id": 1, "op": "ping"})], "BAD_VERSION"),
    ("unknown op", lambda: [req("drop_tables")], "UNKNOWN_OP"),
    ("op missing", lambda: [msgpack.packb({"v": PROTOCOL_VERSION, "id": 1})], "UNKNOWN_OP"),
    ("op wrong type", lambda: [msgpack.packb({"v": PROTOCOL_VERSION, "id": 1, "op": 5})], "UNKNOWN_OP"),
    ("negative id", lambda: [msgpack.packb({"v": PROTOCOL_VERSION, "id": -1, "op": "ping"})], "OUT_OF_RANGE"),
    ("id as string", lambda: [msgpack.packb({"v": PROTOCOL_VERSION, "id": "x", "op": "ping"})], "BAD_FIELD"),
    ("unexpected field", lambda: [req("ping", admin=True)], "BAD_FIELD"),
    ("lookup without tokens", lambda: [req("lookup", keyspace=ks_wire())], "BAD_FIELD"),
    ("tokens as int list", lambda: [req("lookup", keyspace=ks_wire(), tokens=[1, 2, 3])], "BAD_FIELD"),
    ("tokens not x4 bytes", lambda: [req("lookup", keyspace=ks_wire(), tokens=b"\x00" * 7)], "BAD_FIELD"),
    (
        "huge token array",
        lambda: [req("lookup", keyspace=ks_wire(), tokens=b"\x00" * 4 * (MAX_TOKENS + 1))],
        "TOO_LARGE",
    ),
    ("keyspace as string", lambda: [req("lookup", keyspace="m", tokens=TOK)], "BAD_FIELD"),
    ("bad fingerprint", lambda: [req("lookup", keyspace=ks_wire(groups=["zz"]), tokens=TOK)], "BAD_FIELD"),
    ("too many groups", lambda: [req("lookup", keyspace=ks_wire(groups=["0" * 16] * 65), tokens=TOK)], "BAD_FIELD"),
    (
        "hostile model name",
        lambda: [req("lookup", keyspace=ks_wire(model="../../etc/passwd\n"), tokens=TOK)],
        "BAD_FIELD",
    ),
    ("salt too long", lambda: [req("lookup", keyspace=ks_wire(), tokens=TOK, salt="s" * 500)], "BAD_FIELD"),
    ("world size zero", lambda: [req("lookup", keyspace=ks_wire(world_size=0), tokens=TOK)], "OUT_OF_RANGE"),
    ("bool as int", lambda: [req("lookup", keyspace=ks_wire(world_size=True), tokens=TOK)], "BAD_FIELD"),
    ("rank beyond world", lambda: [req("store", keyspace=ks_wire(), tokens=TOK, rank=5)], "OUT_OF_RANGE"),
    ("negative rank", lambda: [req("store", keyspace=ks_wire(), tokens=TOK, rank=-1)], "OUT_OF_RANGE"),
    ("unknown mode", lambda: [req("store", keyspace=ks_wire(), tokens=TOK, rank=0, mode="udp")], "BAD_FIELD"),
    (
        "start chunk past end",
        lambda: [req("store", keyspace=ks_wire(), tokens=TOK, rank=0, start_chunk=9)],
        "OUT_OF_RANGE",
    ),
    (
        "negative chunk",
        lambda: [req("retrieve", session=sid("s"), rank=0, start_chunk=-1, end_chunk=1)],
        "OUT_OF_RANGE",
    ),
    (
        "oversize chunk id",
        lambda: [req("retrieve", session=sid("s"), rank=0, start_chunk=0, end_chunk=1 << 40)],
        "OUT_OF_RANGE",
    ),
    (
        "chunks outside lease",
        lambda: [req("retrieve", session=sid("held"), rank=0, start_chunk=0, end_chunk=50)],
        "NOT_LEASED",
    ),
    (
        "reversed range",
        lambda: [req("retrieve", session=sid("held"), rank=0, start_chunk=2, end_chunk=1)],
        "NOT_LEASED",
    ),
    ("session id too long", lambda: [req("release", session=sid("x") * 1000)], "BAD_FIELD"),
    ("unknown store", lambda: [req("commit", store_id="st-nope", checksums=[])], "UNKNOWN_STORE"),
    ("data frames on lookup", lambda: [req("lookup", keyspace=ks_wire(), tokens=TOK), b"payload"], "BAD_FIELD"),
    ("oversize header", lambda: [req("ping") + b"\x00" * (5 << 20)], "TOO_LARGE"),
    ("deeply nested", lambda: [b"\x91" * 100_000 + b"\x00"], "BAD_FRAME"),
    (
        "chunk size mismatch",
        lambda: [req("register_engine", model="m", world_size=1, rank=0, groups=[LAYOUT_BAD_CHUNK])],
        "LAYOUT_MISMATCH",
    ),
    (
        "negative block bytes",
        lambda: [req("register_engine", model="m", world_size=1, rank=0, groups=[LAYOUT_NEG])],
        "OUT_OF_RANGE",
    ),
    (
        "query naming 4096 x 64 objects a chunk",
        lambda: [req("query", keyspace=ks_wire(world_size=4096, groups=["0123456789abcdef"] * 64), tokens=TOK)],
        "TOO_LARGE",
    ),
    (
        "pin of 65536 chunks x 2 ranks",
        lambda: [req("pin", keyspace=ks_wire(world_size=2), tokens=b"\x00" * 4 * 256 * 65536)],
        "TOO_LARGE",
    ),
    (
        "block_shape of 100 dims",
        lambda: [
            req(
                "register_engine",
                model="m",
                world_size=1,
                rank=0,
                groups=[{**tiny_layout().to_wire(), "block_shape": [1] * 100}],
            )
        ],
        "TOO_LARGE",
    ),
    (
        "total_chunks without reservation",
        lambda: [req("store", keyspace=ks_wire(), tokens=TOK, rank=0, total_chunks=1)],
        "BAD_FIELD",
    ),
    (
        "first reserved store without total",
        lambda: [req("store", keyspace=ks_wire(), tokens=TOK, rank=0, reservation="r-none-" + "0" * 30)],
        "BAD_FIELD",
    ),
    (
        "reservation of zero chunks",
        lambda: [
            req("store", keyspace=ks_wire(), tokens=TOK, rank=0, reservation="r-zero-" + "0" * 30, total_chunks=0)
        ],
        "OUT_OF_RANGE",
    ),
    (
        "reservation id too long",
        lambda: [req("store", keyspace=ks_wire(), tokens=TOK, rank=0, reservation="r" * 1000, total_chunks=1)],
        "BAD_FIELD",
    ),
    (
        "reservation of all of L1, partly in use",
        lambda: [
            req("store", keyspace=ks_wire(), tokens=TOK, rank=0, reservation="r-huge-" + "0" * 30, total_chunks=1 << 14)
        ],
        "RETRY_LATER",
    ),
    (
        "first store beyond its own total",
        lambda: [
            req("store", keyspace=ks_wire(), tokens=TOK * 2, rank=0, reservation="r-over-" + "0" * 30, total_chunks=1)
        ],
        "BAD_FIELD",
    ),
    (
        "layout extra field",
        lambda: [
            req(
                "register_engine",
                model="m",
                world_size=1,
                rank=0,
                groups=[{**tiny_layout().to_wire(), "exec": "rm -rf /"}],
            )
        ],
        "BAD_FIELD",
    ),
]


@pytest.fixture
def prepared(server):
    """A server holding real data and one live session, plus a raw DEALER socket."""
    global GOOD_KS, AUTH
    AUTH = resolve_token(None, server.url)
    c = server.client()
    GOOD_KS, _ = register(c)
    size = tiny_layout().object_bytes
    store(c, GOOD_KS, TOKENS, lambda ch, g: payload(ch, size))
    assert lookup(c, GOOD_KS, TOKENS, session=sid("held")) == 512
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.url)
    yield c, sock
    sock.close()
    c.close()


def test_every_malformed_request_gets_a_coded_error_and_nothing_changes(prepared):
    c, sock = prepared
    before = c.call("describe").result["l1"]
    assert len(CASES) >= 20
    for name, frames, code in CASES:
        sock.send_multipart(frames())
        assert sock.poll(5000), f"{name}: no reply"
        reply = msgpack.unpackb(sock.recv_multipart()[0])
        assert reply["ok"] is False, name
        assert reply["error"]["code"] == code, (name, reply)
        assert reply["error"]["message"], name
    after = c.call("describe").result
    assert after["l1"]["objects"] == before["objects"] and after["l1"]["used_bytes"] == before["used_bytes"]
    assert sum(after["errors"].values()) >= len(CASES)
    # still serving correctly, stored bytes intact
    size = tiny_layout().object_bytes
    assert retrieve(c, "held", 0, 2) == {(0, 0): payload(0, size), (1, 0): payload(1, size)}
    store(c, GOOD_KS, TOKENS + list(range(256)), lambda ch, g: payload(ch, size))
    assert lookup(c, GOOD_KS, TOKENS + list(range(256))) == 768


def test_reply_keeps_request_id_when_readable(prepared):
    _, sock = prepared
    sock.send_multipart([msgpack.packb({"v": PROTOCOL_VERSION, "id": 12345, "op": "nope"})])
    assert sock.poll(5000)
    assert msgpack.unpackb(sock.recv_multipart()[0])["id"] == 12345


@pytest.mark.parametrize("violation", ["beyond_total", "total_changed"])
def test_reservation_violation_rolls_back_the_whole_request(prepared, violation):
    """A producer that breaks its reservation mid-request loses all of it: the chunks it committed are
    dropped, its open store aborted, the booking released; the id may start afresh."""
    c, _ = prepared
    size = tiny_layout().object_bytes
    tokens = list(range(5000, 5000 + 3 * 256))
    rid = secrets.token_hex(16)
    before = c.call("describe").result["l1"]
    store(c, GOOD_KS, tokens[:256], lambda ch, g: payload(ch, size), reservation=rid, total_chunks=2)
    open_store = store(
        c, GOOD_KS, tokens[:512], lambda ch, g: payload(ch, size), start_chunk=1, reservation=rid, commit=False
    )
    assert open_store["store_id"] and lookup(c, GOOD_KS, tokens) == 256
    bad = {
        "beyond_total": dict(tokens=tokens, total_chunks=2),
        "total_changed": dict(tokens=tokens[:512], total_chunks=3),
    }[violation]
    with pytest.raises(ServerError) as err:
        store(
            c,
            GOOD_KS,
            bad["tokens"],
            lambda ch, g: payload(ch, size),
            start_chunk=1,
            reservation=rid,
            total_chunks=bad["total_chunks"],
            commit=False,
        )
    assert err.value.code == ErrorCode.BAD_FIELD and "rolled back" in err.value.message
    assert lookup(c, GOOD_KS, tokens) == 0  # the committed chunk is gone
    with pytest.raises(ServerError) as err:  # and so is the open store
        c.call("commit", store_id=open_store["store_id"], checksums=[0])
    assert err.value.code == ErrorCode.UNKNOWN_STORE
    after = c.call("describe").result["l1"]
    assert after["objects"] == before["objects"]
    # the booking is released: the same id starts a fresh reservation, which completes
    store(c, GOOD_KS, tokens[:512], lambda ch, g: payload(ch, size), reservation=rid, total_chunks=2)
    assert lookup(c, GOOD_KS, tokens) == 512
