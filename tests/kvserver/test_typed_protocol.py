"""The typed protocol end to end: every op as a Struct over a real server, and HTTP counted like ZMQ."""

from __future__ import annotations

import numpy as np

from kvtestkit.kvhelpers import ArenaMap, payload, register, tiny_layout, sid
from kvprotocol import pack_tokens, replies as rp, requests as rq
from kvprotocol.kvsum import kvsum64

TOKENS = list(range(100, 100 + 512))


def test_every_op_has_a_typed_request_and_reply(server):
    assert set(rq.REQUESTS) == set(rp.REPLIES)
    with server.client() as c:
        ks, _ = register(c)
        kw = rq.KeySpaceW(ks.model, ks.world_size, list(ks.groups))
        layout = tiny_layout()
        pong, _ = c.send(rq.Ping())
        assert isinstance(pong, rp.PingReply) and pong.protocol == 1
        reg, _ = c.send(rq.RegisterEngine(model="m", world_size=1, rank=0, groups=[rq.LayoutW(**layout.to_wire())]))
        assert isinstance(reg, rp.RegisterReply) and reg.groups == [layout.fingerprint]
        tokens = pack_tokens(np.asarray(TOKENS))
        st, _ = c.send(rq.Store(keyspace=kw, tokens=tokens, rank=0, mode="shm"))
        assert isinstance(st, rp.StoreReply) and [s.status for s in st.slots] == ["reserved"] * 2
        arena = ArenaMap(reg.arena.name, reg.arena.size)
        try:
            sums = []
            for s in st.slots:
                assert s.offset is not None
                arena.write(s.offset, payload(s.chunk, layout.object_bytes))
                sums.append(kvsum64(payload(s.chunk, layout.object_bytes)))
            assert st.store_id is not None
            done, _ = c.send(rq.Commit(store_id=st.store_id, checksums=sums))
            assert isinstance(done, rp.CommitReply) and done.committed == 2
            look, _ = c.send(rq.Lookup(keyspace=kw, tokens=tokens, session=sid("typed")))
            assert isinstance(look, rp.LookupReply) and look.hit_tokens == 512
            got, frames = c.send(rq.Retrieve(session=sid("typed"), rank=0, start_chunk=0, end_chunk=2, mode="tcp"))
            assert isinstance(got, rp.RetrieveReply) and [o.chunk for o in got.objects] == [0, 1]
            assert bytes(frames[1]) == payload(1, layout.object_bytes) and got.objects[1].checksum == sums[1]
            rel, _ = c.send(rq.Release(session=sid("typed"), rank=0, lease=got.lease))
            assert isinstance(rel, rp.ReleaseReply) and rel.intact
            q, _ = c.send(rq.Query(keyspace=kw, tokens=tokens))
            assert isinstance(q, rp.QueryReply) and q.prefix_tokens == 512
            pin, _ = c.send(rq.Pin(keyspace=kw, tokens=tokens))
            assert isinstance(pin, rp.PinReply) and pin.objects == 2
            unpin, _ = c.send(rq.Unpin(keyspace=kw, tokens=tokens))
            assert isinstance(unpin, rp.PinReply) and unpin.objects == 2
            end, _ = c.send(rq.EndSession(session=sid("typed")))
            assert isinstance(end, rp.EndSessionReply)
            st2, _ = c.send(rq.Store(keyspace=kw, tokens=pack_tokens(np.arange(256) + 9), rank=0))
            assert st2.store_id is not None
            ab, _ = c.send(rq.Abort(store_id=st2.store_id))
            assert isinstance(ab, rp.AbortReply) and ab.aborted == 1
            desc, _ = c.send(rq.Describe())
            assert isinstance(desc, rp.DescribeReply) and desc.ops["commit"] >= 1
            cleared, _ = c.send(rq.Clear())
            assert isinstance(cleared, rp.ClearReply) and cleared.removed == 2
        finally:
            arena.close()


def test_http_ops_count_in_the_same_metrics_as_zmq(server_factory):
    srv = server_factory("--l1-size-gb", "0.05", http=True)
    with srv.client() as c, srv.http() as h:
        ks, _ = register(c)
        before = c.call("describe").result
        body = {"model": "m", "world_size": 1, "groups": list(ks.groups), "tokens": TOKENS}
        assert h.post("/v1/query", json=body).status_code == 200
        assert h.post("/v1/pin", json=body).status_code == 200
        assert h.post("/v1/query", json={**body, "world_size": 0}).status_code == 422
        after = c.call("describe").result
        assert after["ops"].get("query", 0) - before["ops"].get("query", 0) == 2
        assert after["ops"].get("pin", 0) - before["ops"].get("pin", 0) == 1
        assert after["errors"].get("OUT_OF_RANGE", 0) - before["errors"].get("OUT_OF_RANGE", 0) == 1
        text = h.get("/metrics").text
        assert 'kvserver_request_duration_seconds_count{op="query"} 2.0' in text


async def test_async_client_shares_the_typed_encoding(server):
    from kvprotocol import AsyncClient

    with server.client() as c:
        ks, _ = register(c)
    async with AsyncClient(server.url, token=server.token) as ac:
        pong, _ = await ac.send(rq.Ping())
        assert isinstance(pong, rp.PingReply)
        look, _ = await ac.send(rq.Lookup(keyspace=ks.wire(), tokens=pack_tokens(np.asarray(TOKENS))))
        assert isinstance(look, rp.LookupReply) and look.num_chunks == 2 and look.hit_tokens == 0
