"""Store then lookup/retrieve through a real kvserver process, in both data modes."""

from __future__ import annotations

import pytest

from kvtestkit.kvhelpers import ArenaMap, lookup, payload, register, retrieve, store, tiny_layout, sid
from kvprotocol import KeySpace, ServerError, pack_tokens
from kvprotocol.kvsum import kvsum64

TOKENS = list(range(1000, 1000 + 256 * 4 + 100))  # four full chunks and a tail


@pytest.mark.parametrize("mode", ["tcp", "shm"])
def test_store_then_retrieve_exact_bytes(server, mode):
    with server.client() as c:
        layouts = [tiny_layout(), tiny_layout(block_bytes=2048, tag="mla")]
        ks, reg = register(c, layouts=layouts)
        arena = ArenaMap(reg["arena"]["name"], reg["arena"]["size"]) if mode == "shm" else None
        size = {0: layouts[0].object_bytes, 1: layouts[1].object_bytes}
        data = {(ch, g): payload(ch * 10 + g, size[g]) for ch in range(4) for g in range(2)}
        reply = store(c, ks, TOKENS, lambda ch, g: data[(ch, g)], mode=mode, arena=arena)
        assert [s["status"] for s in reply["slots"]] == ["reserved"] * 8  # only full chunks
        assert lookup(c, ks, TOKENS, session=sid("s1")) == 4 * 256
        got = retrieve(c, "s1", 0, 4, mode=mode, arena=arena)
        assert got == data
        c.call("end_session", session=sid("s1"))


def test_read_your_writes_and_dedup(server):
    with server.client() as c:
        ks, _ = register(c)
        size = tiny_layout().object_bytes
        assert lookup(c, ks, TOKENS) == 0
        store(c, ks, TOKENS[:512], lambda ch, g: payload(ch, size))
        assert lookup(c, ks, TOKENS) == 512  # visible as soon as commit returned
        again = store(c, ks, TOKENS, lambda ch, g: payload(ch + 100, size))
        assert [s["status"] for s in again["slots"]] == ["present", "present", "reserved", "reserved"]
        assert lookup(c, ks, TOKENS, session=sid("rw")) == 1024
        got = retrieve(c, "rw", 0, 2)
        assert got[(0, 0)] == payload(0, size)  # the first writer's bytes, not overwritten


def test_uncommitted_store_is_invisible(server):
    with server.client() as c:
        ks, _ = register(c)
        size = tiny_layout().object_bytes
        reply = store(c, ks, TOKENS, lambda ch, g: payload(ch, size), commit=False)
        assert lookup(c, ks, TOKENS) == 0
        second = store(c, ks, TOKENS, lambda ch, g: payload(ch, size), commit=False)
        assert {s["status"] for s in second["slots"]} == {"writing"}
        c.call("abort", store_id=reply["store_id"])
        assert lookup(c, ks, TOKENS) == 0
        store(c, ks, TOKENS, lambda ch, g: payload(ch, size))
        assert lookup(c, ks, TOKENS) == 1024


def test_prefix_rule_hole_ends_the_hit(server):
    with server.client() as c:
        ks, _ = register(c)
        size = tiny_layout().object_bytes
        store(c, ks, TOKENS, lambda ch, g: payload(ch, size))
        assert lookup(c, ks, TOKENS) == 1024
        # a different token in chunk 2 changes the hash of chunk 2 and of everything after it
        changed = list(TOKENS)
        changed[600] += 1
        assert lookup(c, ks, changed) == 512
        # store only chunk 4..5 of a new prompt without chunk 0..3: nothing is reusable
        other = [t + 7 for t in TOKENS] + list(range(600))
        store(c, ks, other, lambda ch, g: payload(ch, size), start_chunk=4)
        assert lookup(c, ks, other) == 0


def test_all_groups_and_ranks_required(server):
    with server.client() as c:
        layouts = [tiny_layout(), tiny_layout(block_bytes=512)]
        ks, _ = register(c, layouts=layouts, world_size=2)
        sizes = [lay.object_bytes for lay in layouts]
        store(c, ks, TOKENS, lambda ch, g: payload(ch, sizes[g]), rank=0)
        assert lookup(c, ks, TOKENS) == 0  # rank 1 missing everywhere
        # rank 1 stores both groups for chunks 0-1, and only group 0 for chunks 2-3
        store(c, ks, TOKENS[:512], lambda ch, g: payload(ch, sizes[g]), rank=1)
        assert lookup(c, ks, TOKENS) == 512
        partial = c.call("query", keyspace=ks.to_wire(), tokens=pack_tokens(TOKENS)).result
        assert [ch["l1"] for ch in partial["chunks"]] == [4, 4, 2, 2]
        assert partial["prefix_tokens"] == 512


def test_salt_isolates_and_retrieve_needs_a_lease(server):
    with server.client() as c:
        ks, _ = register(c)
        size = tiny_layout().object_bytes
        store(c, ks, TOKENS, lambda ch, g: payload(ch, size), salt="tenant-a")
        assert lookup(c, ks, TOKENS, salt="tenant-a") == 1024
        assert lookup(c, ks, TOKENS, salt="tenant-b") == 0
        assert lookup(c, ks, TOKENS) == 0
        assert lookup(c, ks, TOKENS, salt="tenant-b", session=sid("b")) == 0  # a miss leases nothing
        with pytest.raises(ServerError) as err:
            retrieve(c, "b", 0, 1)
        assert err.value.code == "UNKNOWN_SESSION"
        assert lookup(c, ks, TOKENS[:512], salt="tenant-a", session=sid("a")) == 512
        with pytest.raises(ServerError) as err:
            retrieve(c, "a", 2, 3)  # stored, but past what this session's lookup leased
        assert err.value.code == "NOT_LEASED"
        with pytest.raises(ServerError) as err:
            retrieve(c, "never-looked-up", 0, 1)
        assert err.value.code == "UNKNOWN_SESSION"


def test_store_needs_registered_layout(server):
    with server.client() as c:
        register(c)
        unknown = KeySpace("m", 1, (tiny_layout(block_bytes=4096).fingerprint,))
        with pytest.raises(ServerError) as err:
            store(c, unknown, TOKENS, lambda ch, g: b"")
        assert err.value.code == "LAYOUT_MISMATCH"


def test_tcp_commit_checks_frame_sizes(server):
    with server.client() as c:
        ks, _ = register(c)
        size = tiny_layout().object_bytes
        reply = store(c, ks, TOKENS[:256], lambda ch, g: b"", commit=False)
        with pytest.raises(ServerError) as err:
            c.call("commit", frames=[b"x" * (size - 1)], store_id=reply["store_id"], checksums=[0])
        assert err.value.code == "BAD_FIELD"
        with pytest.raises(ServerError):
            c.call("commit", frames=[], store_id=reply["store_id"], checksums=[0])
        for bad in ([], [0, 0], [-1], ["x"], [True], None, [1.5]):  # one uint64 per reserved slot
            with pytest.raises(ServerError) as err:
                c.call("commit", frames=[payload(1, size)], store_id=reply["store_id"], checksums=bad)
            assert err.value.code in ("BAD_FIELD", "OUT_OF_RANGE")
        with pytest.raises(ServerError) as err:  # the proof of the write is required
            c.call("commit", frames=[payload(1, size)], store_id=reply["store_id"])
        assert err.value.code == "BAD_FIELD"
        assert lookup(c, ks, TOKENS) == 0  # nothing half-committed
        c.call("commit", frames=[payload(1, size)], store_id=reply["store_id"], checksums=[kvsum64(payload(1, size))])
        assert lookup(c, ks, TOKENS) == 256


def test_retrieve_returns_the_committed_checksum(server):
    """The server keeps the writer's checksum with the object and hands it to every reader."""
    with server.client() as c:
        ks, _ = register(c)
        size = tiny_layout().object_bytes
        store(c, ks, TOKENS, lambda ch, g: payload(ch, size))
        assert lookup(c, ks, TOKENS, session=sid("cs")) == 4 * 256
        reply = c.call("retrieve", session=sid("cs"), rank=0, start_chunk=0, end_chunk=2, mode="tcp")
        for obj, frame in zip(reply.result["objects"], reply.frames, strict=True):
            assert obj["checksum"] == kvsum64(payload(obj["chunk"], size)) == kvsum64(frame)


def test_engine_table_dedupes_reregistration_and_stays_bounded(server):
    with server.client() as c:
        layout = tiny_layout().to_wire()
        first = c.call("register_engine", model="m", world_size=1, rank=0, groups=[layout], host="h", pid=7).result
        again = c.call("register_engine", model="m", world_size=1, rank=0, groups=[layout], host="h", pid=7).result
        assert again["engine_id"] == first["engine_id"]
        for i in range(300):
            c.call("register_engine", model="m", world_size=1, rank=0, groups=[layout], host="h", pid=100 + i)
        engines = c.call("describe").result["engines"]
        assert len(engines) == 256
        assert engines[-1]["pid"] == 399 and first["engine_id"] not in {e["id"] for e in engines}
