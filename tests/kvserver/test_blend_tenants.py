"""CacheBlend under tenants, against a real kvserver (#34 finding 4): blend stores and blend lookups go
through the same admission as prefix stores and lookups, so a tenant's quota, store cap, session cap
and other producers' bookings bind them too. Each test runs the attack as carol (a 3-object quota,
2 sessions, 1 store in flight) and shows alice is still served.
"""

from __future__ import annotations

from typing import Any

from kvtestkit.kvhelpers import payload, register, sid, store
from kvprotocol import Client, pack_tokens
from test_blend_index import blend_lookup, blend_store, docs, prompt_of
import test_tenants
from test_tenants import OBJ, code_of

C = 256
tenancy = test_tenants.tenancy  # the tenants fixture: alice, bob, and carol with small limits


def statuses(reply: dict[str, Any]) -> list[str]:
    return [s["status"] for s in reply["slots"]]


def doc_of(chunks: int, first: int) -> list[int]:
    return list(range(first, first + chunks * C))


def test_blend_stores_count_against_the_tenants_quota(tenancy: Any) -> None:
    _, admin, c, ks, _, _ = tenancy
    alice, carol = c["alice"], c["carol"]
    mine = doc_of(2, 1_000)
    assert statuses(blend_store(alice, ks, mine, lambda ch, g: payload(ch, OBJ))) == ["reserved"] * 2
    assert statuses(blend_store(carol, ks, doc_of(2, 10_000), lambda ch, g: payload(ch, OBJ))) == ["reserved"] * 2
    # four more: within her 3-object quota her own older objects are evicted, then the fourth is refused
    reply = blend_store(carol, ks, doc_of(4, 20_000), lambda ch, g: payload(ch, OBJ))
    assert statuses(reply) == ["reserved"] * 3 + ["no_space"]
    row = admin.call("describe").result["tenants"]["carol"]
    assert row["l1_used_bytes"] == 3 * OBJ and row["quota_evictions"] == 2 and row["quota_refusals"] == 1
    tokens, starts = prompt_of([mine])
    assert len(blend_lookup(alice, ks, tokens, starts)["matches"]) == 2  # alice's objects untouched


def test_blend_and_prefix_objects_share_one_quota(tenancy: Any) -> None:
    """The tenant's L1 quota is one budget for prefix and blend objects: carol's blend store past it
    evicts her own prefix objects, and her prefix store past it evicts her blend objects, never alice's."""
    _, admin, c, ks, _, _ = tenancy
    alice, carol = c["alice"], c["carol"]
    mine = doc_of(2, 1_000)
    assert statuses(blend_store(alice, ks, mine, lambda ch, g: payload(ch, OBJ))) == ["reserved"] * 2
    prefix = doc_of(2, 60_000)
    assert statuses(store(carol, ks, prefix, lambda ch, g: payload(ch, OBJ))) == ["reserved"] * 2

    def carol_row() -> dict[str, Any]:
        return admin.call("describe").result["tenants"]["carol"]

    def prefix_hit() -> int:
        return carol.call("lookup", keyspace=ks.to_wire(), tokens=pack_tokens(prefix)).result["hit_chunks"]

    assert carol_row()["l1_used_bytes"] == 2 * OBJ and prefix_hit() == 2
    blend = doc_of(2, 70_000)
    assert statuses(blend_store(carol, ks, blend, lambda ch, g: payload(ch, OBJ))) == ["reserved"] * 2
    row = carol_row()
    assert row["l1_used_bytes"] == 3 * OBJ and row["quota_evictions"] == 1 and row["quota_refusals"] == 0
    assert prefix_hit() < 2  # her own prefix made room for her blend object
    tokens, starts = prompt_of([blend])
    assert len(blend_lookup(carol, ks, tokens, starts)["matches"]) == 2
    more = doc_of(2, 80_000)  # two prefix chunks more: her blend objects go, one is refused
    assert statuses(store(carol, ks, more, lambda ch, g: payload(ch, OBJ))) == ["reserved"] * 2
    row = carol_row()
    assert row["l1_used_bytes"] == 3 * OBJ and row["quota_evictions"] == 3
    assert len(blend_lookup(carol, ks, tokens, starts)["matches"]) < 2
    tokens, starts = prompt_of([mine])
    assert len(blend_lookup(alice, ks, tokens, starts)["matches"]) == 2  # alice's objects untouched


def test_blend_and_prefix_stores_share_the_tenants_store_cap(tenancy: Any) -> None:
    _, _, c, ks, _, _ = tenancy
    alice, carol = c["alice"], c["carol"]
    held = carol.call(
        "blend_store", keyspace=ks.to_wire(), tokens=pack_tokens(doc_of(1, 30_000)), rank=0, mode="tcp"
    ).result
    assert held["store_id"] is not None  # open, never committed: her one store in flight
    assert code_of(lambda: blend_store(carol, ks, doc_of(1, 31_000), lambda ch, g: payload(ch, OBJ))) == "TOO_MANY"
    assert code_of(lambda: store(carol, ks, doc_of(1, 32_000), lambda ch, g: payload(ch, OBJ))) == "TOO_MANY"
    assert statuses(blend_store(alice, ks, doc_of(1, 33_000), lambda ch, g: payload(ch, OBJ))) == ["reserved"]
    carol.call("abort", store_id=held["store_id"])
    assert statuses(blend_store(carol, ks, doc_of(1, 31_000), lambda ch, g: payload(ch, OBJ))) == ["reserved"]


def test_blend_lookup_sessions_count_against_the_tenants_session_cap(tenancy: Any) -> None:
    _, _, c, ks, _, _ = tenancy
    alice, carol = c["alice"], c["carol"]
    (doc,) = docs(1)
    for who in (alice, carol):
        blend_store(who, ks, doc, lambda ch, g: payload(ch, OBJ))
    tokens, starts = prompt_of([doc])
    for s in ("b1", "b2"):
        assert blend_lookup(carol, ks, tokens, starts, session=sid(s))["matches"]
    assert code_of(lambda: blend_lookup(carol, ks, tokens, starts, session=sid("b3"))) == "TOO_MANY"
    assert blend_lookup(alice, ks, tokens, starts, session=sid("b3"))["matches"]  # alice is not affected
    carol.call("end_session", session=sid("b1"))
    assert blend_lookup(carol, ks, tokens, starts, session=sid("b3"))["matches"]


def test_blend_stores_leave_another_producers_booking_alone(server_factory: Any) -> None:
    """A whole-request reservation books L1 for a producer's remaining chunks; a blend store may take
    only what the bookings leave free, as a plain store may (#41: one admission path)."""
    srv = server_factory("--l1-size-gb", str(64 * OBJ / (1 << 30)), "--lease-ttl", "30")
    with srv.client() as admin, Client(srv.url, token=srv.token) as other:
        ks, _ = register(admin)
        capacity = admin.call("describe").result["l1"]["capacity_bytes"] // OBJ
        booked = store(
            admin,
            ks,
            doc_of(1, 40_000),
            lambda ch, g: payload(ch, OBJ),
            reservation=sid("r1"),
            total_chunks=capacity - 2,
        )
        assert statuses(booked) == ["reserved"]  # chunk 0 written; capacity - 3 chunks stay booked
        reply = blend_store(other, ks, doc_of(4, 50_000), lambda ch, g: payload(ch, OBJ))
        assert statuses(reply) == ["reserved"] * 2 + ["no_space"] * 2, statuses(reply)
        assert admin.call("describe").result["reservations"]["live"] == 1  # the booking was not broken
