"""The server's index of stored tail lengths (service/tails.py): bounded, most recent first."""

from __future__ import annotations

from kvprotocol import KeySpace
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
