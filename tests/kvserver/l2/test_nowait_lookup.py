"""Lookups with `wait: false`: the answer never waits for L2; a prefetch runs in the background and a
later lookup of the same tokens reports what it brought into L1 (`pending: false`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvtestkit.kvhelpers import register, retrieve, store
from kvtestkit.kvhelpers import sid
from kvprotocol import ServerError, pack_tokens
from l2util import data, prompt, wait_tier, wait_until

L1 = ("--l1-size-gb", "0.02")


def _lookup(c, ks, tokens, session: str | None = None, **more):  # type: ignore[no-untyped-def]
    fields = {"keyspace": ks.to_wire(), "tokens": pack_tokens(tokens), **more}
    if session:
        fields["session"] = sid(session)
    return c.call("lookup", **fields).result


def test_lookup_without_wait_answers_pending_then_the_l2_hit(server_factory, tmp_path: Path) -> None:
    root = tmp_path / "l2"
    args = (*L1, "--l2", f"fs://{root}")
    a = server_factory(*args)
    warm = prompt(4, seed=1)
    with a.client() as c:
        ks, _ = register(c)
        store(c, ks, warm, data(1))
        wait_tier(c, "puts", 4)
    a.stop()
    b = server_factory(*args)  # L1 empty, L2 holds the 4 chunks
    with b.client() as c:
        ks, _ = register(c)
        first = _lookup(c, ks, warm, session=sid("s"), wait=False)
        assert first["hit_tokens"] == 0 and first["pending"] is True  # answered before any L2 read
        final = wait_until(
            lambda: (r := _lookup(c, ks, warm, session=sid("s"), wait=False))["pending"] is False and r,
            what="the background prefetch to end",
        )
        assert final["hit_tokens"] == 4 * 256
        assert retrieve(c, "s", 0, 4) == {(ch, 0): data(1)(ch, 0) for ch in range(4)}
        # a prompt L2 does not hold: pending once, then a final miss (no endless "pending")
        cold = prompt(3, seed=2)
        assert _lookup(c, ks, cold, wait=False)["pending"] is True
        wait_until(lambda: _lookup(c, ks, cold, wait=False)["pending"] is False, what="the empty prefetch to end")
        # an L1 hit of the whole prompt needs no prefetch: not pending
        assert _lookup(c, ks, warm, wait=False) == {**final, "pending": False}
        # the default still waits, and says nothing of pending
        assert "pending" not in _lookup(c, ks, warm)


def test_wait_must_be_a_bool(server_factory) -> None:
    s = server_factory(*L1)
    with s.client() as c:
        ks, _ = register(c)
        with pytest.raises(ServerError) as err:
            _lookup(c, ks, prompt(1), wait=0)
        assert err.value.code == "BAD_FIELD"
        assert _lookup(c, ks, prompt(1), wait=False)["hit_tokens"] == 0  # no L2: never pending
