"""Every ZMQ reply is its kvprotocol._replies Struct, on the wire and in the server.

One script runs every op (errors included) twice: against a real kvserver over a bare DEALER socket,
where each raw reply frame must be exactly its Struct's schema (no unknown key, no required key
missing, no optional key sent as its default: absent fields are left out, as the hand-built maps
did), and through an in-process server's dispatch, where each handler's result must be an instance
of its op's reply Struct (a reply built as a map again fails here).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec
import msgspec.inspect as mi
import numpy as np
import pytest
import zmq

from kvprotocol import ServerError, pack_tokens
from kvprotocol import _replies as rp
from kvprotocol import _requests as rq
from kvprotocol._client import _encode
from kvprotocol._credentials import resolve_token
from kvprotocol._envelope import ErrorEnvelope, OkEnvelope, encode_reply, ok_reply
from kvprotocol.kvsum import kvsum64
from kvserver.config import ServerConfig
from kvserver.runtime.describe import describe_reply, describe_tenant
from kvserver.runtime.server import KVServer
from kvserver.security.tenants import DEFAULT, Identity
from kvtestkit.kvhelpers import payload, sid, tiny_layout
from kvtestkit.ports import free_port

Send = Callable[[rq.Request[Any], Sequence[bytes]], tuple[Any, list[bytes]]]
LAYOUT = tiny_layout()
TOKENS = pack_tokens(np.arange(100, 100 + 512))  # two chunks of the tiny layout
EC_SPACE = "0123456789abcdef"
# fields typed loosely (clients read them as maps) whose entries the server builds from a Struct
ENTRIES: dict[tuple[type, str], type] = {
    (rp.ECLookupReply, "items"): rp.ECObject,
    (rp.BlendLookupReply, "matches"): rp.BlendMatch,
}
_ids = itertools.count(1)


class _Ok(msgspec.Struct, forbid_unknown_fields=True):
    id: int
    ok: bool
    result: msgspec.Raw


class _Err(msgspec.Struct, forbid_unknown_fields=True):
    id: int
    ok: bool
    error: _ErrBody


class _ErrBody(msgspec.Struct, forbid_unknown_fields=True):
    code: str
    message: str


def _check(value: Any, t: mi.Type, where: str) -> None:
    """`value` (a decoded map) has exactly the schema of `t`, nested Structs included."""
    if isinstance(t, mi.StructType):
        assert isinstance(value, dict), f"{where}: {value!r} is not a map"
        fields = {f.encode_name: f for f in t.fields}
        assert set(value) <= set(fields), f"{where}: unknown keys {set(value) - set(fields)}"
        for f in t.fields:
            if f.required:
                assert f.encode_name in value, f"{where}: required {f.encode_name} missing"
            elif f.encode_name in value:  # every default of a reply means "absent": it is left out
                assert value[f.encode_name] != f.default, f"{where}: {f.encode_name} sent as its default"
        for key, v in value.items():
            _check(v, fields[key].type, f"{where}.{key}")
            entry = ENTRIES.get((t.cls, key))
            if entry is not None:
                for i, item in enumerate(v):
                    if item is not None:
                        _check(item, mi.type_info(entry), f"{where}.{key}[{i}]")
    elif isinstance(t, mi.ListType) and isinstance(value, list):
        for i, item in enumerate(value):
            _check(item, t.item_type, f"{where}[{i}]")
    elif isinstance(t, mi.UnionType):
        structs = [x for x in t.types if isinstance(x, mi.StructType)]
        if structs and value is not None:
            _check(value, structs[0], where)


def _script(send: Send) -> set[str]:
    """Every op once or more, errors too; returns the ops that were answered."""
    done: set[str] = set()

    def run(req: rq.Request[Any], frames: Sequence[bytes] = ()) -> Any:
        done.add(req.op_name())
        return send(req, frames)

    ks = rq.KeySpaceW("m", 1, [LAYOUT.fingerprint])
    run(rq.Ping())
    run(rq.RegisterEngine(model="m", world_size=1, rank=0, groups=[rq.LayoutW(**LAYOUT.to_wire())]))
    assert run(rq.Lookup(keyspace=ks, tokens=TOKENS))[0].hit_chunks == 0
    computing = pack_tokens(np.arange(5000, 5000 + 512))
    assert run(rq.Announce(keyspace=ks, tokens=computing, session=sid("announcer"), ttl_s=5.0))[0].announced == 2
    assert run(rq.Lookup(keyspace=ks, tokens=computing))[0].inflight is True
    st, _ = run(rq.Store(keyspace=ks, tokens=TOKENS, rank=0, mode="tcp"))
    assert st.store_id is not None and all(s.offset is None for s in st.slots)
    data = [payload(s.chunk, s.size) for s in st.slots]
    run(rq.Commit(store_id=st.store_id, checksums=[kvsum64(d) for d in data]), data)
    shm_store, _ = run(rq.Store(keyspace=ks, tokens=pack_tokens(np.arange(256) + 9), rank=0, mode="shm"))
    assert shm_store.slots[0].offset is not None
    run(rq.Abort(store_id=shm_store.store_id))
    assert [s.status for s in run(rq.Store(keyspace=ks, tokens=TOKENS, rank=0))[0].slots] == ["present"] * 2
    session = sid("replies")
    look, _ = run(rq.Lookup(keyspace=ks, tokens=TOKENS, session=session, rank=0, wait=False))
    assert look.hit_chunks == 2 and look.pending is None and look.inflight is None
    got, frames = run(rq.Retrieve(session=session, rank=0, start_chunk=0, end_chunk=2, mode="tcp"))
    assert frames == data and all(o.offset is None for o in got.objects)
    assert run(rq.Release(session=session, rank=0, lease=got.lease))[0].intact
    run(rq.Lookup(keyspace=ks, tokens=TOKENS, session=session))
    got, frames = run(rq.Retrieve(session=session, rank=0, start_chunk=0, end_chunk=2, mode="shm"))
    assert not frames and all(o.offset is not None for o in got.objects)
    run(rq.EndSession(session=session))
    assert run(rq.Query(keyspace=ks, tokens=TOKENS))[0].prefix_tokens == 512
    assert run(rq.Pin(keyspace=ks, tokens=TOKENS))[0].objects == 2
    run(rq.Unpin(keyspace=ks, tokens=TOKENS))
    with pytest.raises(ServerError, match=r"UNKNOWN_SESSION|NOT_LEASED"):
        run(rq.Retrieve(session=sid("never-looked-up"), rank=0, start_chunk=0, end_chunk=1))
    doc = pack_tokens(np.arange(7000, 7000 + 256))
    bst, _ = run(rq.BlendStore(keyspace=ks, tokens=doc, rank=0, pos_base=256, mode="tcp"))
    bdata = [payload(9, s.size) for s in bst.slots]
    run(rq.Commit(store_id=bst.store_id, checksums=[kvsum64(d) for d in bdata]), bdata)
    assert run(rq.BlendLookup(keyspace=ks, tokens=TOKENS + doc, starts=[0, 512]))[0].hit_tokens == 256
    blob = payload(5, 96)
    ec: dict[str, Any] = {"model": "m", "space": EC_SPACE}
    est, _ = run(rq.ECStore(**ec, item="img-1", dtype="float32", shape=[4, 6], size=96, mode="tcp"))
    assert est.status == "reserved" and est.offset is None and est.arena is None
    run(rq.ECCommit(store_id=est.store_id, checksum=kvsum64(blob)), [blob])
    assert run(rq.ECStore(**ec, item="img-1", dtype="float32", shape=[4, 6], size=96))[0].status == "present"
    shm_ec, _ = run(rq.ECStore(**ec, item="img-2", dtype="float32", shape=[4], size=16, mode="shm"))
    run(rq.ECAbort(store_id=shm_ec.store_id))
    found, _ = run(rq.ECLookup(**ec, items=["img-1", "img-9"], readers=1))
    assert found.items[0] is not None and found.items[1] is None
    run(rq.ECRelease(lease=found.items[0]["lease"] if isinstance(found.items[0], dict) else found.items[0].lease))
    assert run(rq.ECRetrieve(**ec, item="img-1", mode="tcp"))[1] == [blob]
    shm_got, _ = run(rq.ECRetrieve(**ec, item="img-1", mode="shm"))
    assert shm_got.lease is not None and shm_got.arena is not None
    run(rq.ECRelease(lease=shm_got.lease))
    assert run(rq.ECRetrieve(**ec, item="img-9"))[0].found is False
    run(rq.ECClear())
    run(rq.Describe())
    run(rq.Clear())
    return done


def test_raw_replies_of_a_real_server_are_exactly_their_structs(server) -> None:
    """The wire: a bare DEALER, each reply frame decoded strictly against its op's Struct."""
    token = resolve_token(server.token, server.url)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(server.url)

    def send(req: rq.Request[Any], frames: Sequence[bytes]) -> tuple[Any, list[bytes]]:
        rid = next(_ids)
        sock.send_multipart([_encode(req, rid, token), *frames])
        head, *data = sock.recv_multipart()
        env = msgspec.msgpack.decode(head)
        if env.get("ok") is False:
            err = msgspec.msgpack.decode(head, type=_Err)
            assert err.id == rid
            raise ServerError(err.error.code, err.error.message)
        ok = msgspec.msgpack.decode(head, type=_Ok)
        assert ok.id == rid and ok.ok is True
        cls = rp.REPLIES[req.op_name()]
        _check(msgspec.msgpack.decode(ok.result), mi.type_info(cls), req.op_name())
        return msgspec.msgpack.decode(ok.result, type=cls), data

    try:
        assert _script(send) == set(rq.REQUESTS)
    finally:
        sock.close()


@pytest.fixture
def in_process() -> Iterator[KVServer]:
    prefix = f"kvtest-replies-{os.getpid()}"
    srv = KVServer(ServerConfig(port=free_port(), http_port=0, l1_size_gb=0.02, ec_size_gb=0.01, shm_prefix=prefix))
    try:
        yield srv
    finally:
        srv._built = False  # never served: close() removes its arenas instead of leaving them to adopt
        srv.close()


def test_every_handler_answers_its_reply_struct(in_process: KVServer) -> None:
    """The server side: dispatch hands the ZMQ loop an envelope holding the op's own reply Struct."""
    token = in_process.api_token

    def send(req: rq.Request[Any], frames: Sequence[bytes]) -> tuple[Any, list[bytes]]:
        answer = in_process._begin(_encode(req, next(_ids), token), [memoryview(f) for f in frames])
        assert isinstance(answer, tuple), "no handler waits without L2"
        env, data = answer
        in_process._after.run()
        if isinstance(env, ErrorEnvelope):
            raise ServerError(env.error.code, env.error.message)
        assert isinstance(env, OkEnvelope)
        assert type(env.result) is rp.REPLIES[req.op_name()], f"{req.op_name()}: {type(env.result).__name__}"
        cls = rp.REPLIES[req.op_name()]
        raw = msgspec.msgpack.decode(encode_reply(env))["result"]
        _check(raw, mi.type_info(cls), req.op_name())
        return env.result, [bytes(d) for d in data]

    assert _script(send) == set(rq.REQUESTS)


def test_describe_keeps_both_of_its_shapes(in_process: KVServer) -> None:
    """describe's two shapes, as encoded: the server's token gets exactly the map HTTP and /metrics
    read (describe_server), a tenant's token its own six keys (no admin field sent empty or nil)."""
    for reply, keys in (
        (describe_reply(in_process), set(in_process.describe())),
        (
            describe_tenant(in_process, Identity(DEFAULT, shm=False)),
            {"version", "protocol", "uptime_s", "chunk_size", "tenant", "tenants"},
        ),
    ):
        raw = msgspec.msgpack.decode(encode_reply(ok_reply(1, reply)))["result"]
        assert set(raw) == keys
        _check(raw, mi.type_info(rp.DescribeReply), "describe")


def test_the_typed_describe_reads_a_server_with_every_optional_part(server_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The client decodes describe into DescribeReply: a server with L2 tiers (a list, one map per
    tier) and KV events must decode, or every typed caller of describe fails against such servers."""
    s = server_factory(
        "--l2", f"fs://{tmp_path / 'a'}", "--l2", f"fs://{tmp_path / 'b'}",
        "--kv-events-endpoint", f"ipc://{tmp_path}/events.ipc", "--kv-events-topic", "kv@t@{model}",
    )  # fmt: skip
    with s.client() as c:
        d = c.describe()
    assert isinstance(d.l2, list) and [t["url"] for t in d.l2] == [f"fs://{tmp_path / x}" for x in "ab"]
    assert isinstance(d.l2_queue, dict) and isinstance(d.kv_events, dict)
