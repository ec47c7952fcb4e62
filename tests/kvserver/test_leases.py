"""Leases and reservations expire, so a crashed client cannot pin memory forever; leases are held per
reader rank, and a reader always learns whether its leases were held through its copy."""

from __future__ import annotations

import time

import pytest

from kvtestkit.kvhelpers import ArenaMap, lookup, payload, register, retrieve, store, tiny_layout, sid
from kvprotocol import ServerError, pack_tokens
from kvprotocol.kvsum import kvsum64

TOKENS = list(range(512))


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_read_lease_expires(server_factory):
    srv = server_factory("--l1-size-gb", "0.05", "--lease-ttl", "0.5")
    with srv.client() as c:
        ks, _ = register(c)
        store(c, ks, TOKENS, lambda ch, g: payload(ch, tiny_layout().object_bytes))
        assert lookup(c, ks, TOKENS, session=sid("crashy")) == 512
        assert c.call("describe").result["l1"]["leased"] == 2
        assert wait_for(lambda: c.call("describe").result["l1"]["leased"] == 0)
        with pytest.raises(ServerError) as err:
            retrieve(c, "crashy", 0, 2)
        assert err.value.code == "UNKNOWN_SESSION"
        assert c.call("describe").result["counters"]["expired_sessions"] == 1


def test_write_reservation_expires(server_factory):
    srv = server_factory("--l1-size-gb", "0.05", "--lease-ttl", "0.5")
    with srv.client() as c:
        ks, _ = register(c)
        reply = store(c, ks, TOKENS, lambda ch, g: b"", commit=False)
        assert c.call("describe").result["l1"]["writing"] == 2
        assert wait_for(lambda: c.call("describe").result["l1"]["writing"] == 0)
        with pytest.raises(ServerError) as err:
            c.call("commit", frames=[b"x"] * 2, store_id=reply["store_id"], checksums=[0, 0])
        assert err.value.code == "UNKNOWN_STORE"
        assert lookup(c, ks, TOKENS) == 0
        store(c, ks, TOKENS, lambda ch, g: payload(ch, tiny_layout().object_bytes))  # slots reusable
        assert lookup(c, ks, TOKENS) == 512


def test_retrieve_refreshes_and_release_returns_leases(server):
    with server.client() as c:
        ks, _ = register(c)
        store(c, ks, TOKENS, lambda ch, g: payload(ch, tiny_layout().object_bytes))
        lookup(c, ks, TOKENS, session=sid("s"))
        lookup(c, ks, TOKENS, session=sid("s"))  # a repeated lookup replaces, never stacks, leases
        assert c.call("describe").result["l1"]["leased"] == 2
        assert c.call("release", session=sid("s")).result == {"released": True, "intact": True}
        assert c.call("describe").result["l1"]["leased"] == 0
        assert c.call("release", session=sid("s")).result == {"released": False, "intact": False}


def test_store_ids_are_128_bit_random(server):
    with server.client() as c:
        ks, _ = register(c)
        ids = {store(c, ks, list(range(i, i + 256)), lambda ch, g: b"", commit=False)["store_id"] for i in range(3)}
    assert len(ids) == 3
    for store_id in ids:
        assert store_id.startswith("st-") and len(store_id) == 3 + 32 and int(store_id[3:], 16) >= 0


def test_leases_are_held_per_reader_rank(server):
    """Each rank of a session releases only its own leases; the session ends after the last one."""
    obj = tiny_layout().object_bytes
    with server.client() as c:
        ks, _ = register(c, world_size=2)
        for rank in (0, 1):
            store(c, ks, TOKENS, lambda ch, g, r=rank: payload(10 * r + ch, obj), rank=rank)
        assert lookup(c, ks, TOKENS, session=sid("tp")) == 512
        assert c.call("describe").result["l1"]["leased"] == 4  # 2 chunks x 2 ranks
        lease0 = c.call("retrieve", session=sid("tp"), rank=0, start_chunk=0, end_chunk=2, mode="tcp").result["lease"]
        reply1 = c.call("retrieve", session=sid("tp"), rank=1, start_chunk=0, end_chunk=2, mode="tcp")
        lease1 = reply1.result["lease"]
        assert lease0 != lease1
        assert c.call("release", session=sid("tp"), rank=0, lease=lease0).result == {"released": True, "intact": True}
        assert c.call("describe").result["l1"]["leased"] == 2  # rank 1 still holds its objects
        assert c.call("describe").result["sessions"] == 1
        with pytest.raises(ServerError) as err:  # rank 0 is done with this session
            retrieve(c, "tp", 0, 2, rank=0)
        assert err.value.code == "NOT_LEASED"
        assert retrieve(c, "tp", 0, 2, rank=1)[(1, 0)] == payload(11, obj)
        assert c.call("release", session=sid("tp"), rank=1, lease=lease1).result == {"released": True, "intact": True}
        assert c.call("describe").result["l1"]["leased"] == 0
        assert c.call("describe").result["sessions"] == 0


def test_a_reader_learns_when_its_leases_were_dropped_under_it(server):
    """Someone else's release, a replacing lookup, or a re-lease all leave the reader's number stale."""
    obj = tiny_layout().object_bytes
    with server.client() as c:
        ks, _ = register(c, world_size=2)
        for rank in (0, 1):
            store(c, ks, TOKENS, lambda ch, g: payload(ch, obj), rank=rank)
        lookup(c, ks, TOKENS, session=sid("s"))
        lease = c.call("retrieve", session=sid("s"), rank=1, start_chunk=0, end_chunk=1, mode="shm").result["lease"]
        # a bad client releases rank 1's leases, then leases rank 1 again: the reader must not be fooled
        assert c.call("release", session=sid("s"), rank=1).result == {"released": True, "intact": True}
        lookup_fields = {"keyspace": ks.to_wire(), "tokens": pack_tokens(TOKENS), "session": sid("s"), "rank": 1}
        assert c.call("lookup", **lookup_fields).result["hit_tokens"] == 512
        assert c.call("release", session=sid("s"), rank=1, lease=lease).result == {"released": False, "intact": False}
        assert c.call("describe").result["counters"]["broken_reads"] == 1
        # the new reader is still there for its owner (a stale number releases nothing)
        assert c.call("describe").result["l1"]["leased"] == 4
        # a full lookup replaces every reader: rank 0's earlier number is stale too
        lease0 = c.call("retrieve", session=sid("s"), rank=0, start_chunk=0, end_chunk=1).result["lease"]
        lookup(c, ks, TOKENS, session=sid("s"))
        assert c.call("release", session=sid("s"), rank=0, lease=lease0).result["intact"] is False
        with pytest.raises(ServerError) as err:
            c.call("release", session=sid("s"), lease=lease0)
        assert err.value.code == "BAD_FIELD"
        with pytest.raises(ServerError) as err:
            c.call("lookup", **{**lookup_fields, "rank": 2})
        assert err.value.code == "OUT_OF_RANGE"
        assert c.call("release", session=sid("s")).result == {"released": True, "intact": True}
        assert c.call("describe").result["l1"]["leased"] == 0


def test_expired_session_is_not_intact_even_if_leased_again(server_factory):
    srv = server_factory("--l1-size-gb", "0.05", "--lease-ttl", "0.5")
    with srv.client() as c:
        ks, _ = register(c)
        store(c, ks, TOKENS, lambda ch, g: payload(ch, tiny_layout().object_bytes))
        lookup(c, ks, TOKENS, session=sid("slow"))
        lease = c.call("retrieve", session=sid("slow"), rank=0, start_chunk=0, end_chunk=2).result["lease"]
        assert wait_for(lambda: c.call("describe").result["sessions"] == 0)
        lookup(c, ks, TOKENS, session=sid("slow"))  # e.g. the scheduler looked the request up again
        released = c.call("release", session=sid("slow"), rank=0, lease=lease).result
        assert released == {"released": False, "intact": False}


def test_late_writer_cannot_reach_a_reused_slot(server_factory):
    """A reservation that expires keeps its slot out of use for a lease TTL; its commit is refused."""
    obj = tiny_layout().object_bytes  # 16 KiB: the arena below has room for exactly 4
    srv = server_factory("--l1-size-gb", str(4 * obj / (1 << 30)), "--lease-ttl", "2")
    with srv.client() as c:
        ks, reg = register(c)
        arena = ArenaMap(reg["arena"]["name"], reg["arena"]["size"])
        late = store(c, ks, TOKENS, lambda ch, g: b"", mode="shm", arena=arena, commit=False)
        late_offsets = {s["offset"] for s in late["slots"]}
        assert len(late_offsets) == 2
        assert wait_for(lambda: c.call("describe").result["l1"]["quarantined"] == 2)
        # the writer is stalled past its deadline; meanwhile other stores fill the arena
        others = list(range(1000, 1000 + 4 * 256))
        reply = store(c, ks, others, lambda ch, g: payload(100 + ch, obj), mode="shm", arena=arena)
        given = [s for s in reply["slots"] if s["status"] == "reserved"]
        assert len(given) == 2 and not {s["offset"] for s in given} & late_offsets
        assert [s["status"] for s in reply["slots"]][2:] == ["no_space", "no_space"]
        for off in late_offsets:  # the late writer wakes up and writes anyway
            arena.write(off, b"\xee" * obj)
        with pytest.raises(ServerError) as err:
            c.call("commit", store_id=late["store_id"], checksums=[kvsum64(b"\xee" * obj)] * 2)
        assert err.value.code == "UNKNOWN_STORE"
        lookup(c, ks, others[:512], session=sid("r"))
        got = retrieve(c, "r", 0, 2, mode="shm", arena=arena)
        assert got == {(0, 0): payload(100, obj), (1, 0): payload(101, obj)}
        c.call("release", session=sid("r"))
        # after the quarantine the slots serve again
        assert wait_for(lambda: c.call("describe").result["l1"]["quarantined"] == 0)
        reply = store(c, ks, others, lambda ch, g: payload(100 + ch, obj), start_chunk=2)
        assert [s["status"] for s in reply["slots"]] == ["reserved", "reserved"]
        assert lookup(c, ks, others) == 4 * 256  # the freed quarantine made room, nothing was evicted
        arena.close()


def test_a_lookup_that_hits_nothing_leaves_no_session_to_release(server):
    """An engine's scheduler releases a session only when its lookup hit: a miss must leave nothing
    behind (a live session would count against the session caps until its TTL)."""
    with server.client() as c:
        ks, _ = register(c)
        store(c, ks, TOKENS, lambda ch, g: payload(ch, tiny_layout().object_bytes))
        assert lookup(c, ks, TOKENS, session="hit") == 512
        assert c.call("describe").result["sessions"] == 1
        other = list(range(5000, 5600))
        assert lookup(c, ks, other, session="miss") == 0
        assert c.call("describe").result["sessions"] == 1  # only the hit's
        assert lookup(c, ks, other, session="hit") == 0  # a repeated lookup that now misses
        assert c.call("describe").result["sessions"] == 0
        assert c.call("describe").result["l1"]["leased"] == 0
