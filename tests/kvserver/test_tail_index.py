"""The server's index of stored tail lengths (service/tails.py): bounded, most recent first, shared
fairly between tenants."""

from __future__ import annotations

from kvprotocol import KeySpace
from kvserver.security.tenants import tenant_of_salt
from kvserver.service.tails import MAX_LENGTHS, TailIndex

KS = KeySpace("m", 1, ("0" * 16,))


def test_lengths_are_kept_per_chunk_most_recent_first_and_at_most_a_few() -> None:
    index = TailIndex()
    parent = (KS, "", b"p" * 32)
    for n in (10, 20, 10, 30, 40, 50):
        index.add(parent, n)
    assert index.lengths(parent) == (50, 40, 30, 10)[:MAX_LENGTHS]
    assert index.lengths((KS, "other-salt", b"p" * 32)) == ()  # the salt (a tenant's scope) is part of it


def test_the_least_recently_stored_chunks_are_forgotten_first() -> None:
    index = TailIndex(max_parents=2)
    a, b, c = ((KS, "", bytes([i]) * 32) for i in range(3))
    index.add(a, 1)
    index.add(b, 2)
    index.add(a, 3)  # a is stored again: b is now the oldest
    index.add(c, 4)
    assert len(index) == 2
    assert index.lengths(b) == () and index.lengths(a) == (3, 1) and index.lengths(c) == (4,)


def test_a_tenant_storing_without_end_pushes_out_only_its_own_lengths() -> None:
    index = TailIndex(max_parents=8, owner=tenant_of_salt)
    kept = [(KS, "~a~", bytes([i]) * 32) for i in range(3)]
    for p in kept:
        index.add(p, 7)
    for i in range(1000):  # tenant b floods: a full index forgets b's oldest, never a's
        index.add((KS, "~b~s", i.to_bytes(32, "big")), 5)
    assert len(index) == 8 and index.held("a") == 3 and index.held("b") == 5
    assert all(index.lengths(p) == (7,) for p in kept)
    assert index.lengths((KS, "~b~s", (999).to_bytes(32, "big"))) == (5,)
    assert index.lengths((KS, "~b~s", (0).to_bytes(32, "big"))) == ()


def test_a_tenant_below_its_share_takes_room_from_the_largest_holder() -> None:
    index = TailIndex(max_parents=8, owner=tenant_of_salt)
    for i in range(8):
        index.add((KS, "~b~", i.to_bytes(32, "big")), 5)
    for i in range(4):  # a's share of two owners is 4: each of its adds forgets b's oldest
        index.add((KS, "~a~", i.to_bytes(32, "big")), 7)
    assert index.held("a") == 4 and index.held("b") == 4
    assert index.lengths((KS, "~b~", (3).to_bytes(32, "big"))) == ()
    assert index.lengths((KS, "~b~", (4).to_bytes(32, "big"))) == (5,)
    index.add((KS, "~a~", (4).to_bytes(32, "big")), 7)  # at its share: a forgets its own oldest
    assert index.held("a") == 4 and index.lengths((KS, "~a~", (0).to_bytes(32, "big"))) == ()
