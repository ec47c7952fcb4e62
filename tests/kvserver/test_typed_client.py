"""The typed client (one method per op, shared by Client and AsyncClient) and the session id rule,
against a real server."""

from __future__ import annotations

import asyncio
import inspect
import re

import numpy as np
import pytest

from kvtestkit.kvhelpers import payload, register, tiny_layout
from kvprotocol import AsyncClient, ServerError, flows, new_session_id, pack_tokens
from kvprotocol import replies as rp
from kvprotocol import requests as rq
from kvprotocol._typed import TypedOps
from kvprotocol.kvsum import kvsum64

TOKENS = pack_tokens(np.arange(512, dtype=np.uint32) + 4000)


def test_every_op_has_one_method_with_exactly_its_request_fields() -> None:
    for op, cls in rq.REQUESTS.items():
        method = getattr(TypedOps, op)
        params = set(inspect.signature(method).parameters) - {"self", "timeout", "frames"}
        assert params == set(cls.__struct_fields__) - {"v", "id", "auth"}, op
        assert ("frames" in inspect.signature(method).parameters) == cls.DATA_IN, op


def test_new_session_ids_are_128_bit_random_and_accepted() -> None:
    ids = {new_session_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(re.fullmatch(rq.SESSION_ID_RE, s) and len(s) == 22 for s in ids)


def test_sync_typed_methods_store_lookup_retrieve(server) -> None:
    with server.client() as c:
        ks, _ = register(c)
        size = tiny_layout().object_bytes
        assert isinstance(c.ping(), rp.PingReply)
        st = c.store(keyspace=ks.wire(), tokens=TOKENS, rank=0, mode="tcp")
        assert isinstance(st, rp.StoreReply) and st.store_id is not None
        frames = [payload(s.chunk, size) for s in st.slots]
        assert c.commit(store_id=st.store_id, checksums=[kvsum64(f) for f in frames], frames=frames).committed == 2
        session = c.new_session()
        assert c.lookup(keyspace=ks.wire(), tokens=TOKENS, session=session).hit_tokens == 512
        got, data = c.retrieve(session=session, rank=0, start_chunk=0, end_chunk=2, mode="tcp")
        assert [bytes(d) for d in data] == frames and isinstance(got, rp.RetrieveReply)
        assert c.release(session=session, rank=0, lease=got.lease).intact
        assert c.query(keyspace=ks.wire(), tokens=TOKENS).prefix_tokens == 512
        assert c.describe().ops["commit"] >= 1
        assert c.clear().removed == 2


def test_async_typed_methods_share_the_table(server) -> None:
    with server.client() as c:
        ks, _ = register(c)

    async def run() -> None:
        async with AsyncClient(server.url, token=server.token) as ac:
            pongs = await asyncio.gather(*(ac.ping() for _ in range(8)))
            assert all(isinstance(p, rp.PingReply) for p in pongs)
            reply = await ac.lookup(keyspace=ks.wire(), tokens=TOKENS, session=ac.new_session())
            assert isinstance(reply, rp.LookupReply) and reply.hit_tokens == 0
            assert isinstance(await ac.end_session(session=new_session_id()), rp.EndSessionReply)

    asyncio.run(run())


@pytest.mark.parametrize("bad", ["s1", "x" * 21, "a" * 129, "has space in it, 22 chars", "dots.are.not.allowed.ok"])
def test_a_guessable_session_id_is_refused_and_opens_nothing(server, bad: str) -> None:
    with server.client() as c:
        ks, _ = register(c)
        flows.store_and_commit(
            c.send,
            rq.Store(keyspace=ks.wire(), tokens=TOKENS, rank=0, mode="tcp"),
            lambda _r, slots: ([payload(0, s.size) for s in slots], [kvsum64(payload(0, s.size)) for s in slots]),
        )
        before = c.describe().sessions
        for call in (
            lambda: c.lookup(keyspace=ks.wire(), tokens=TOKENS, session=bad),
            lambda: c.retrieve(session=bad, rank=0, start_chunk=0, end_chunk=1),
            lambda: c.release(session=bad),
            lambda: c.end_session(session=bad),
        ):
            with pytest.raises(ServerError) as err:
                call()
            assert err.value.code == "BAD_FIELD" and "session" in err.value.message
        assert c.describe().sessions == before
        assert c.ping().protocol == 1  # and the server keeps serving
