"""Leases and reservations expire, so a crashed client cannot pin memory forever."""

from __future__ import annotations

import time

import pytest

from kvhelpers import lookup, payload, register, retrieve, store, tiny_layout
from kvprotocol import ServerError

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
        assert lookup(c, ks, TOKENS, session="crashy") == 512
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
        lookup(c, ks, TOKENS, session="s")
        lookup(c, ks, TOKENS, session="s")  # a repeated lookup replaces, never stacks, leases
        assert c.call("describe").result["l1"]["leased"] == 2
        assert c.call("release", session="s").result == {"released": True}
        assert c.call("describe").result["l1"]["leased"] == 0
        assert c.call("release", session="s").result == {"released": False}
