"""Whole-request reservations are bounded (#34 finding 7), against a real kvserver with real tenants.

The attack: a tenant without a quota books all of L1 in one reservation, writes nothing, and keeps the
booking alive with empty stores; everyone else gets `no_space`. Now a tenant's reservations book at
most its cap (1/4 of L1 by default), one without a commit ends one lease TTL after its last progress
(empty stores renew nothing), and every reservation ends at its maximum lifetime.
"""

from __future__ import annotations

import time

from kvtestkit.kvhelpers import lookup, payload, register, sid, store, tiny_layout
from kvprotocol import Client, ServerError
from kvtestkit.tenants import add_tenant

OBJ = tiny_layout().object_bytes
CHUNK = 256


def tokens(seed: int, chunks: int) -> list[int]:
    return list(range(seed * 100_000, seed * 100_000 + chunks * CHUNK))


def book(c: Client, ks, rid: str, total: int) -> dict:
    """A reservation's first store that writes nothing (no full chunk): it only books `total` chunks."""
    return store(c, ks, [], None, reservation=sid(rid), total_chunks=total, commit=False)


def code_of(fn) -> str:
    try:
        fn()
    except ServerError as exc:
        return str(exc.code)
    raise AssertionError("no error")


def tenants_row(admin: Client, name: str) -> dict:
    return admin.call("describe").result["tenants"][name]


def wait_for(cond, what: str, timeout: float = 15.0, step=None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        if step is not None:
            step()
        time.sleep(0.05)


def start(server_factory, tmp_path, *flags: str):
    tenants = tmp_path / "tenants.json"
    toks = {"alice": add_tenant(tenants, "alice"), "mallory": add_tenant(tenants, "mallory")}
    srv = server_factory("--l1-size-gb", "0.05", "--tenants-file", str(tenants), *flags)
    admin = srv.client()
    ks, _ = register(admin)
    return admin, Client(srv.url, token=toks["alice"]), Client(srv.url, token=toks["mallory"]), ks


def test_one_tenant_cannot_book_all_of_l1(server_factory, tmp_path):
    admin, alice, mallory, ks = start(server_factory, tmp_path, "--lease-ttl", "30")
    capacity = admin.call("describe").result["l1"]["capacity_bytes"]
    cap = tenants_row(admin, "mallory")["max_reserved_bytes"]
    assert cap == capacity // 4
    assert code_of(lambda: book(mallory, ks, "r-all", capacity // OBJ)) == "NO_SPACE"  # the attack: all of L1
    book(mallory, ks, "r-cap", cap // OBJ)  # as much as her cap allows
    assert tenants_row(admin, "mallory")["reserved_bytes"] == cap // OBJ * OBJ
    assert code_of(lambda: book(mallory, ks, "r-more", 2)) == "RETRY_LATER"  # her cap is booked
    assert tenants_row(admin, "mallory")["refused_reservations"] == 2
    # alice stores (plain, then a whole request of her own) in the room mallory could not book
    for seed in range(1, 9):
        reply = store(alice, ks, tokens(seed, 2), lambda ch, g, s=seed: payload(s * 10 + ch, OBJ))
        assert [s["status"] for s in reply["slots"]] == ["reserved", "reserved"]
        assert lookup(alice, ks, tokens(seed, 2)) == 2 * CHUNK
    reply = store(alice, ks, tokens(20, 4), lambda ch, g: payload(ch, OBJ), reservation=sid("a-req"), total_chunks=4)
    assert [s["status"] for s in reply["slots"]] == ["reserved"] * 4
    assert admin.call("describe").result["reservations"]["completed"] == 1
    for c in (alice, mallory, admin):
        c.close()


def test_empty_stores_do_not_keep_a_booking_alive(server_factory, tmp_path):
    admin, alice, mallory, ks = start(server_factory, tmp_path, "--lease-ttl", "1")
    cap = tenants_row(admin, "mallory")["max_reserved_bytes"]
    book(mallory, ks, "r-idle", cap // OBJ)
    assert admin.call("describe").result["reservations"]["live"] == 1
    # she keeps storing nothing under it; within a TTL and a sweep it is rolled back all the same
    wait_for(
        lambda: admin.call("describe").result["reservations"]["rolled_back"] == 1,
        "an idle booking kept alive by empty stores",
        step=lambda: book(mallory, ks, "r-idle", cap // OBJ),
    )
    assert tenants_row(admin, "mallory")["reserved_bytes"] in (0, cap // OBJ * OBJ)  # gone, or booked anew
    # a bystander's whole request, chunk by chunk, is admitted and completes
    for chunk in range(3):
        reply = store(
            alice,
            ks,
            tokens(1, chunk + 1),
            lambda ch, g: payload(ch, OBJ),
            start_chunk=chunk,
            reservation=sid("a-req"),
            total_chunks=3,
        )
        assert [s["status"] for s in reply["slots"]] == ["reserved"]
    assert admin.call("describe").result["reservations"]["completed"] == 1
    assert lookup(alice, ks, tokens(1, 3)) == 3 * CHUNK
    for c in (alice, mallory, admin):
        c.close()


def test_a_reservation_ends_at_its_lifetime_whatever_it_commits(server_factory, tmp_path):
    admin, alice, mallory, ks = start(server_factory, tmp_path, "--lease-ttl", "30", "--reservation-lifetime", "2")
    total = 500  # more than she will ever write: her booking never completes
    t = tokens(3, 60)
    chunk = 0

    def progress() -> None:  # one chunk committed at a time: progress, which renews the idle deadline
        nonlocal chunk
        if chunk < 60:
            store(
                mallory,
                ks,
                t[: (chunk + 1) * CHUNK],
                lambda ch, g: payload(ch, OBJ),
                start_chunk=chunk,
                reservation=sid("r-long"),
                total_chunks=total,
            )
            chunk += 1

    progress()
    wait_for(lambda: admin.call("describe").result["reservations"]["rolled_back"] == 1, "no lifetime", step=progress)
    assert chunk < 60  # it ended while she was still committing
    assert lookup(mallory, ks, t[:CHUNK]) == 0  # what it committed went with it
    # the store that found it past its lifetime may book the same id afresh: that booking too ends
    # at its own lifetime, and nothing stays booked
    wait_for(lambda: tenants_row(admin, "mallory")["reserved_bytes"] == 0, "a booking outlived its lifetime")
    for c in (alice, mallory, admin):
        c.close()
