"""Announced chunks against a real kvserver: a lookup that stops at a chunk another session announced
is answered `inflight` until that session stores it or the announcement lapses; the announcer's own
lookups, other salts and other tenants are never held back; bad announcements change nothing."""

from __future__ import annotations

import pytest

from kvprotocol import Client, ServerError, pack_tokens
from kvtestkit.coordproc import wait_for
from kvtestkit.kvhelpers import payload, register, sid, store, tiny_layout
from kvserver.service.announcements import Announcements
from kvtestkit.tenants import add_tenant

CHUNK = 256
OBJ = tiny_layout(CHUNK).object_bytes


def fill_store(chunk: int, group: int) -> bytes:
    return payload(chunk, OBJ)


def tokens(seed: int, chunks: int) -> list[int]:
    return list(range(seed * 100_000, seed * 100_000 + chunks * CHUNK))


def ask(c: Client, ks, toks: list[int], session: str | None = None, salt: str = "") -> dict:
    fields = {"keyspace": ks.to_wire(), "tokens": pack_tokens(toks), "salt": salt}
    if session is not None:
        fields["session"] = session
    return dict(c.call("lookup", **fields).result)


def announce(c: Client, ks, toks: list[int], session: str, ttl_s: float, start: int = 0, salt: str = "") -> int:
    got = c.call(
        "announce",
        keyspace=ks.to_wire(),
        tokens=pack_tokens(toks),
        session=session,
        start_chunk=start,
        ttl_s=ttl_s,
        salt=salt,
    )
    return int(got.result["announced"])


def test_a_lookup_waits_for_an_announced_chunk_until_it_is_stored(server_factory) -> None:
    srv = server_factory("--l1-size-gb", "0.05", "--chunk-size", str(CHUNK))
    with srv.client() as engine_a, srv.client() as engine_b:
        ks, _ = register(engine_a)
        p = tokens(1, 3)
        store(engine_a, ks, p[:CHUNK], fill_store)  # chunk 0 is stored; A computes chunks 1-2 now
        a = sid("engine-a-request")
        assert announce(engine_a, ks, p, a, ttl_s=5.0, start=1) == 2
        b = ask(engine_b, ks, p, session=sid("engine-b-request"))
        assert b["inflight"] and b["hit_tokens"] == CHUNK  # stops at chunk 1: announced, ask again later
        assert not ask(engine_a, ks, p, session=a).get("inflight")  # never its own announcement
        assert not ask(engine_b, ks, p, salt="another-salt").get("inflight")  # another key space
        store(engine_a, ks, p, fill_store, start_chunk=1)  # A's save lands
        b = ask(engine_b, ks, p, session=sid("engine-b-again"))
        assert not b.get("inflight") and b["hit_tokens"] == 3 * CHUNK
        d = engine_a.call("describe").result["announcements"]
        assert d["announced"] == 2 and d["waits"] == 1


def test_an_announcement_lapses_and_the_first_announcer_keeps_the_chunk(server_factory) -> None:
    srv = server_factory("--l1-size-gb", "0.05", "--chunk-size", str(CHUNK))
    with srv.client() as c:
        ks, _ = register(c)
        p = tokens(2, 2)
        first, second = sid("first"), sid("second")
        assert announce(c, ks, p, first, ttl_s=0.5) == 2
        assert announce(c, ks, p, second, ttl_s=5.0) == 0  # another engine computes them already
        assert ask(c, ks, p, session=sid("reader"))["inflight"]
        # the first announcer never stores (it died): after its ttl, lookups compute instead of waiting
        wait_for(lambda: not ask(c, ks, p).get("inflight"), timeout=10, what="the announcement lapsed")
        assert announce(c, ks, p, second, ttl_s=5.0) == 2  # a lapsed claim is free to take
        assert ask(c, ks, p, session=first)["inflight"]  # now the second's


def test_tenants_never_wait_for_each_other_and_each_has_a_cap(server_factory, tmp_path) -> None:
    tenants = tmp_path / "tenants.json"
    toks = {name: add_tenant(tenants, name) for name in ("alice", "mallory")}
    srv = server_factory("--l1-size-gb", "0.05", "--chunk-size", str(CHUNK), "--tenants-file", str(tenants))
    with (
        srv.client() as admin,
        Client(srv.url, token=toks["alice"]) as alice,
        Client(srv.url, token=toks["mallory"]) as mallory,
    ):
        ks, _ = register(admin)
        p = tokens(3, 4)
        # mallory announces alice's prompt (same tokens, same salt as alice would name): in mallory's
        # own namespace, so alice's lookups never wait for it
        assert announce(mallory, ks, p, sid("m"), ttl_s=5.0) == 4
        assert not ask(alice, ks, p, session=sid("a")).get("inflight")
        assert ask(mallory, ks, p, session=sid("m2"))["inflight"]  # its own tenant's other sessions do
        assert announce(alice, ks, p, sid("a2"), ttl_s=5.0) == 4  # mallory's claims are not alice's


def test_a_tenants_live_announcements_are_capped_and_lapse() -> None:
    """The book itself (announcements.py), with a clock of its own: a tenant at its cap is refused
    more, other tenants are not, and lapsed claims stop counting once swept."""
    now = [100.0]
    book = Announcements(clock=lambda: now[0], per_tenant=3)
    refs = [("m", 1, "~mallory~", bytes([i]) * 16) for i in range(5)]
    assert book.announce("mallory\x00s", "mallory", refs, 1.0) == 3
    assert book.refused == 2 and len(book.by_chunk) == 3
    assert book.announce("alice\x00s", "alice", [("m", 1, "", b"a" * 16)], 1.0) == 1
    assert book.inflight(refs[0], "mallory\x00other") and not book.inflight(refs[0], "mallory\x00s")
    assert not book.inflight(refs[4], "mallory\x00other")  # refused: never announced
    now[0] += 2.0  # every claim lapsed; the next announcement sweeps them
    assert not book.inflight(refs[0], "mallory\x00other")
    assert book.announce("mallory\x00s", "mallory", refs[3:], 1.0) == 2
    assert book.held["mallory"] == 2 and "alice" not in book.held


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"ttl_s": 0.0}, "OUT_OF_RANGE"),
        ({"ttl_s": 60.0}, "OUT_OF_RANGE"),
        ({"start_chunk": 3}, "OUT_OF_RANGE"),
        ({"session": "short"}, "BAD_FIELD"),
    ],
)
def test_bad_announcements_are_refused_and_change_nothing(server_factory, fields, code) -> None:
    srv = server_factory("--l1-size-gb", "0.05", "--chunk-size", str(CHUNK))
    with srv.client() as c:
        ks, _ = register(c)
        p = tokens(4, 2)
        body = {"keyspace": ks.to_wire(), "tokens": pack_tokens(p), "session": sid("x"), "ttl_s": 1.0, **fields}
        with pytest.raises(ServerError) as err:
            c.call("announce", **body)
        assert str(err.value.code).endswith(code)
        assert c.call("describe").result["announcements"]["live"] == 0
        assert not ask(c, ks, p).get("inflight")
        assert c.call("ping").result["protocol"] == 1  # and the server serves on
