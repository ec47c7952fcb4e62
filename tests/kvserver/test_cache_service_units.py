"""CacheService in-process, on a real shm arena: the read path, the write path, leases, eviction and
expiry driven op by op, and every refusal raised as the server's own error class with its wire code.

The subprocess tests (test_store_retrieve.py, test_leases.py, ...) cover the same ops through ZMQ;
these reach the states a client cannot time (an expired store, a full arena of leased objects).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator

import pytest

from kvprotocol import ErrorCode, LayoutDescriptor, pack_tokens
from kvprotocol import _replies as rp
from kvprotocol._requests import KeySpaceW, LayoutW, Lookup, Pin, Query, RegisterEngine, Release, Retrieve, Store
from kvserver.service import admission as store_admission
from kvserver.l1.arena import Arena
from kvserver.service.cache import CacheService
from kvserver.errors import (
    BadField,
    KVServerError,
    LayoutMismatch,
    NoSpace,
    NotLeased,
    OutOfCapacity,
    OutOfRange,
    TooLarge,
    TooMany,
    UnknownSession,
    UnknownStore,
    wire_error,
)
from kvserver.l1.eviction import LRUPolicy
from kvserver.l1.cache import L1Cache
from kvserver.l1.slab import ALIGN
from kvserver.security.tenants import ADMIN, Identity

CHUNK = 16  # tokens per chunk
SLOTS = 8  # the arena holds this many one-chunk objects
LAYOUT = LayoutDescriptor("vllm_cpu", "float32", 1, CHUNK, ALIGN, CHUNK, (ALIGN // 4,))  # one ALIGN-byte object
_names = itertools.count()


class Rig:
    """One CacheService over a real arena, with helpers that speak its typed requests."""

    def __init__(self, lease_ttl: float = 30.0) -> None:
        self.arena = Arena(f"kvserver-unit-cache-{os.getpid()}-{next(_names)}", SLOTS * ALIGN)
        self.l1 = L1Cache(self.arena, LRUPolicy())
        self.svc = CacheService(self.l1, CHUNK, lease_ttl)
        reply = self.svc.register_engine(self.register(), "eng-1")
        self.fp = reply.groups[0]

    @staticmethod
    def register(layout: LayoutDescriptor = LAYOUT, rank: int = 0, world: int = 1) -> RegisterEngine:
        return RegisterEngine(model="m", world_size=world, rank=rank, groups=[LayoutW(**layout.to_wire())])

    def ks(self, world: int = 1, fp: str | None = None) -> KeySpaceW:
        return KeySpaceW(model="m", world_size=world, groups=[fp or self.fp])

    @staticmethod
    def tokens(chunks: int, seed: int = 0) -> bytes:
        return pack_tokens([seed * 100_000 + i for i in range(chunks * CHUNK)])

    def store(self, chunks: int, seed: int = 0, who: Identity = ADMIN, **kw: object) -> dict:
        return self.svc.store(Store(keyspace=self.ks(), tokens=self.tokens(chunks, seed), rank=0, **kw), who)

    def put(self, chunks: int, seed: int = 0, who: Identity = ADMIN) -> list[bytes]:
        """Store and commit `chunks` chunks (shm: the bytes written straight into the arena); their bytes."""
        reply = self.store(chunks, seed, who)
        data = []
        for slot in reply.slots:
            if slot.status == "reserved":
                blob = bytes([seed * 16 + slot.chunk + 1]) * slot.size
                self.arena.write(slot.offset, blob)
                data.append(blob)
        if reply.store_id is not None:
            self.svc.commit(reply.store_id, [], [7] * len(data), who)
        return data

    def lookup(self, chunks: int, seed: int = 0, session: str | None = None, who: Identity = ADMIN) -> int:
        req = Lookup(keyspace=self.ks(), tokens=self.tokens(chunks, seed), session=session)
        return int(self.svc.lookup(req, who).hit_chunks)

    def close(self) -> None:
        self.arena.close()


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.close()


def test_register_engine_answers_the_arena_and_refuses_what_cannot_fit(rig: Rig) -> None:
    reply = rig.svc.register_engine(rig.register(), "eng-2")
    assert reply.arena.name == rig.arena.name and reply.chunk_size == CHUNK
    assert reply.groups == [LAYOUT.fingerprint] and "eng-2" in rig.svc.engines
    odd = LayoutDescriptor("vllm_cpu", "float32", 1, 8, ALIGN, 8, (ALIGN // 4,))  # 8 is not a multiple of 16
    with pytest.raises(LayoutMismatch, match="not a multiple"):
        rig.svc.register_engine(rig.register(odd), "eng-3")
    huge = LayoutDescriptor("vllm_cpu", "float32", SLOTS + 1, CHUNK, ALIGN, CHUNK, (ALIGN // 4,))
    with pytest.raises(NoSpace, match="larger than the whole L1 arena"):
        rig.svc.register_engine(rig.register(huge), "eng-4")
    with pytest.raises(OutOfRange):
        rig.svc.register_engine(rig.register(rank=2, world=2), "eng-5")


def test_store_commit_then_lookup_query_and_pin_see_the_prefix(rig: Rig) -> None:
    assert rig.lookup(3) == 0
    rig.put(3)
    assert rig.lookup(3) == 3 and rig.lookup(5) == 3  # a longer prompt hits the stored prefix
    assert rig.lookup(3, seed=1) == 0
    q = rig.svc.query(Query(keyspace=rig.ks(), tokens=rig.tokens(4)), ADMIN)
    assert [c["l1"] for c in q.chunks] == [1, 1, 1, 0] and q.prefix_tokens == 3 * CHUNK
    c = rig.svc.counters
    assert c.stored_objects == 3 and c.stored_bytes == 3 * ALIGN and c.lookups == 4
    assert c.lookup_hit_tokens == 6 * CHUNK
    pin = Pin(keyspace=rig.ks(), tokens=rig.tokens(4))
    assert rig.svc.set_pinned(pin, True, ADMIN) == rp.PinReply(3)  # the absent fourth chunk: nothing
    assert rig.l1.pinned_objects() == 3


def test_a_second_store_of_present_chunks_reserves_nothing(rig: Rig) -> None:
    rig.put(2)
    again = rig.store(3)
    assert [s.status for s in again.slots] == ["present", "present", "reserved"]
    assert rig.svc.counters.deduplicated_objects == 2
    rig.svc.abort(again.store_id, ADMIN)


def test_commit_refusals_carry_their_codes_and_leave_the_store_open(rig: Rig) -> None:
    reply = rig.store(2)
    sid = reply.store_id
    with pytest.raises(BadField, match="expected 2 checksums") as bad:
        rig.svc.commit(sid, [], [1], ADMIN)
    assert bad.value.code is ErrorCode.BAD_FIELD
    with pytest.raises(BadField, match="shm-mode commit takes no data frames"):
        rig.svc.commit(sid, [memoryview(b"x")], [1, 2], ADMIN)
    with pytest.raises(UnknownStore):  # another tenant's store is as unknown as none
        rig.svc.commit(sid, [], [1, 2], Identity("other"))
    assert rig.svc.commit(sid, [], [1, 2], ADMIN) == rp.CommitReply(2)
    with pytest.raises(UnknownStore) as gone:
        rig.svc.commit(sid, [], [1, 2], ADMIN)
    assert wire_error(gone.value) == (ErrorCode.UNKNOWN_STORE, f"unknown or expired store {sid}")


def test_tcp_commit_checks_frame_sizes_then_writes_the_bytes(rig: Rig) -> None:
    reply = rig.store(2, mode="tcp")
    assert all(s.offset is None for s in reply.slots)
    sid = reply.store_id
    with pytest.raises(BadField, match="expected 2 data frames"):
        rig.svc.commit(sid, [memoryview(b"a" * ALIGN)], [1, 2], ADMIN)
    with pytest.raises(BadField, match="has 3 bytes"):
        rig.svc.commit(sid, [memoryview(b"abc"), memoryview(b"b" * ALIGN)], [1, 2], ADMIN)
    rig.svc.commit(sid, [memoryview(b"a" * ALIGN), memoryview(b"b" * ALIGN)], [11, 22], ADMIN)
    assert rig.lookup(2, session="s") == 2
    result, frames = rig.svc.retrieve(Retrieve(session="s", rank=0, start_chunk=0, end_chunk=2, mode="tcp"), ADMIN)
    assert frames == [b"a" * ALIGN, b"b" * ALIGN]
    assert [o.checksum for o in result.objects] == [11, 22]


def test_abort_quarantines_the_slots_for_one_lease_ttl_then_gives_them_back() -> None:
    r = Rig(lease_ttl=0.05)
    try:
        reply = r.store(3)
        assert r.l1.used_bytes == 3 * ALIGN and r.lookup(3) == 0  # reserved is not readable
        assert r.svc.abort(reply.store_id, ADMIN) == rp.AbortReply(3)
        with pytest.raises(UnknownStore):
            r.svc.abort(reply.store_id, ADMIN)
        assert r.l1.quarantined_bytes == 3 * ALIGN  # a late writer may still be copying into them
        assert len(r.put(SLOTS, seed=1)) == SLOTS - 3  # three slots held back, nothing evictable
        assert r.svc.counters.no_space == 3
        time.sleep(0.1)
        r.svc.expire()
        r.put(3, seed=2)  # the quarantine is over: its three slots hold new objects, nothing evicted
        assert r.lookup(3, seed=2) == 3 and r.l1.quarantined_bytes == 0 and r.l1.evictions == 0
    finally:
        r.close()


def test_store_refuses_bad_requests_before_changing_anything(rig: Rig) -> None:
    with pytest.raises(LayoutMismatch, match="not registered"):
        rig.svc.store(Store(keyspace=rig.ks(fp="f" * 16), tokens=rig.tokens(1), rank=0), ADMIN)
    with pytest.raises(OutOfRange, match="rank must be < world_size"):
        rig.svc.store(Store(keyspace=rig.ks(), tokens=rig.tokens(1), rank=1), ADMIN)
    with pytest.raises(OutOfRange, match="start_chunk"):
        rig.store(1, start_chunk=2)
    with pytest.raises(OutOfRange):  # an extra key beyond the last full chunk
        rig.store(1, extra=[(3, b"\x01" * 32)])
    with pytest.raises(TooLarge) as big:
        rig.svc.lookup(Lookup(keyspace=rig.ks(world=2), tokens=b"\0" * (4 << 20)), ADMIN)
    assert big.value.code is ErrorCode.TOO_LARGE
    assert rig.l1.used_bytes == 0 and not rig.svc.table.stores


def test_too_many_stores_in_flight(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_admission, "MAX_STORES", 1)
    first = rig.store(1)
    with pytest.raises(TooMany, match="1 stores are in flight") as busy:
        rig.store(1, seed=1)
    assert isinstance(busy.value, OutOfCapacity) and busy.value.code is ErrorCode.TOO_MANY
    rig.svc.abort(first.store_id, ADMIN)
    rig.put(1, seed=1)


def test_a_session_leases_its_hit_until_release(rig: Rig) -> None:
    data = rig.put(3)
    assert rig.lookup(3, session="s1") == 3
    assert all(e.leases == 1 for e in rig.l1.entries.values())
    result, frames = rig.svc.retrieve(Retrieve(session="s1", rank=0, start_chunk=0, end_chunk=3), ADMIN)
    assert frames == []  # shm: offsets only
    read = [bytes(rig.arena.read(o.offset, o.size)) for o in result.objects]
    assert read == data and [o.chunk for o in result.objects] == [0, 1, 2]
    with pytest.raises(NotLeased, match="not within the leased prefix"):
        rig.svc.retrieve(Retrieve(session="s1", rank=0, start_chunk=0, end_chunk=4), ADMIN)
    with pytest.raises(UnknownSession):
        rig.svc.retrieve(Retrieve(session="s2", rank=0, start_chunk=0, end_chunk=1), ADMIN)
    with pytest.raises(UnknownSession):  # a session is its tenant's
        rig.svc.retrieve(Retrieve(session="s1", rank=0, start_chunk=0, end_chunk=1), Identity("other"))
    released = rig.svc.release(Release(session="s1", rank=0, lease=result.lease), ADMIN)
    assert released.intact and all(e.leases == 0 for e in rig.l1.entries.values())
    with pytest.raises((NotLeased, UnknownSession)):
        rig.svc.retrieve(Retrieve(session="s1", rank=0, start_chunk=0, end_chunk=1), ADMIN)


def test_end_session_releases_leases_and_aborts_its_stores(rig: Rig) -> None:
    rig.put(2)
    rig.lookup(2, session="s")
    open_store = rig.store(2, seed=1, session="s")
    assert rig.svc.end_session("s", ADMIN) == rp.EndSessionReply(released=True, aborted_stores=1)
    assert open_store.store_id not in rig.svc.table.stores
    assert all(e.leases == 0 for e in rig.l1.entries.values())


def test_eviction_takes_the_least_recently_used_and_never_a_leased_object(rig: Rig) -> None:
    rig.put(4, seed=0)
    rig.put(4, seed=1)  # the arena is full
    assert rig.lookup(4, seed=0, session="keep") == 4  # seed 0: leased and most recently used
    rig.put(2, seed=2)
    assert rig.l1.evictions == 2
    assert rig.lookup(4, seed=0) == 4 and rig.lookup(2, seed=2) == 2
    assert rig.lookup(4, seed=1) == 2  # seed 1's tail went first (commits enter tail first): its prefix stays
    rig.lookup(2, seed=2, session="keep2")
    full = rig.store(3, seed=3)  # only seed 1's two objects are unleased: two fit, the third has no room
    assert [s.status for s in full.slots] == ["reserved", "reserved", "no_space"]
    assert rig.svc.counters.no_space == 1 and rig.l1.evictions == 4
    assert rig.lookup(4, seed=0) == 4 and rig.lookup(2, seed=2) == 2  # the leased ones survived
    rig.svc.abort(full.store_id, ADMIN)


def test_expired_stores_and_sessions_are_swept() -> None:
    r = Rig(lease_ttl=0.05)
    try:
        r.put(2)
        r.lookup(2, session="s")
        late = r.store(1, seed=1)
        time.sleep(0.1)
        with pytest.raises(UnknownStore):  # expired, not yet swept: the same answer as swept
            r.svc.commit(late.store_id, [], [1], ADMIN)
        assert r.svc.counters.late_commits == 1
        r.svc.expire()
        assert not r.svc.table.sessions and r.svc.counters.expired_sessions == 1
        assert all(e.leases == 0 for e in r.l1.entries.values())
    finally:
        r.close()


def test_every_refusal_is_a_server_error_with_its_wire_code() -> None:
    for cls, code in (
        (NoSpace, ErrorCode.NO_SPACE),
        (TooMany, ErrorCode.TOO_MANY),
        (NotLeased, ErrorCode.NOT_LEASED),
        (UnknownSession, ErrorCode.UNKNOWN_SESSION),
        (LayoutMismatch, ErrorCode.LAYOUT_MISMATCH),
    ):
        exc = cls("why")
        assert isinstance(exc, KVServerError) and exc.code is code
        assert wire_error(exc) == (code, "why") and str(exc) == f"{code}: why"
    assert wire_error(RuntimeError("bug")) is None  # a bug: the door answers INTERNAL
