"""Tenants against a real kvserver process: one test per attack, quotas, caps and exact per-tenant counters.

Tenants are made with the real CLI (`kvserver tenant add`); every client is a real ZMQ client holding
only its own tenant's token.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvtestkit.coordproc import wait_for
from kvtestkit.httpkv import parse_metrics, value
from kvtestkit.kvhelpers import lookup, payload, register, retrieve, sid, store, tiny_layout
from kvprotocol import Client, ServerError, pack_tokens
from kvprotocol.kvsum import kvsum64
from kvtestkit.tenants import add_tenant

OBJ = tiny_layout().object_bytes
T1 = list(range(5000, 5000 + 512))  # two chunks
BIN = Path(sys.executable).parent


@pytest.fixture
def tenancy(server_factory, tmp_path):
    """A server with tenants alice (no limits), bob, and carol (a 3-object quota, 2 sessions, 1 store,
    and shm mode)."""
    tenants = tmp_path / "tenants.json"
    tokens = {
        "alice": add_tenant(tenants, "alice"),
        "bob": add_tenant(tenants, "bob"),
        "carol": add_tenant(
            tenants,
            "carol",
            "--l1-quota-gb",
            str(3 * OBJ / (1 << 30)),
            "--max-sessions",
            "2",
            "--max-stores",
            "1",
            "--allow-shm",
        ),
    }
    srv = server_factory("--l1-size-gb", "0.05", "--lease-ttl", "30", "--tenants-file", str(tenants), http=True)
    clients = {name: Client(srv.url, token=tok) for name, tok in tokens.items()}
    admin = srv.client()
    ks, reg = register(admin)
    yield srv, admin, clients, ks, reg, tenants
    for c in clients.values():
        c.close()
    admin.close()


def code_of(fn) -> str:
    with pytest.raises(ServerError) as err:
        fn()
    return str(err.value.code)


def test_tenants_file_is_private_and_holds_no_token(tenancy):
    _, _, _, _, _, tenants = tenancy
    assert stat.S_IMODE(os.stat(tenants).st_mode) == 0o600
    text = tenants.read_text()
    assert "kvt-" not in text and "token_sha256" in text


def test_a_tenant_naming_another_tenants_salt_gets_nothing_of_it(tenancy):
    _, admin, c, ks, _, _ = tenancy
    store(c["alice"], ks, T1, lambda ch, g: payload(ch, OBJ), salt="shared")
    assert lookup(c["alice"], ks, T1, salt="shared") == 512
    for other in (c["bob"], admin):  # same tokens, same salt, other tenant: a different key space
        assert lookup(other, ks, T1, salt="shared") == 0
        assert (
            other.call("query", keyspace=ks.to_wire(), tokens=pack_tokens(T1), salt="shared").result["prefix_tokens"]
            == 0
        )
        assert other.call("pin", keyspace=ks.to_wire(), tokens=pack_tokens(T1), salt="shared").result["objects"] == 0
    # nobody can spell a tenant prefix in a salt
    assert code_of(lambda: lookup(c["bob"], ks, T1, salt="~alice~shared")) == "BAD_FIELD"
    # bob's store of the same chunks is his own copy: alice's bytes are untouched
    store(c["bob"], ks, T1, lambda ch, g: payload(100 + ch, OBJ), salt="shared")
    assert lookup(c["alice"], ks, T1, salt="shared", session=sid("a")) == 512
    assert retrieve(c["alice"], "a", 0, 2) == {(0, 0): payload(0, OBJ), (1, 0): payload(1, OBJ)}
    assert lookup(c["bob"], ks, T1, salt="shared", session=sid("b")) == 512
    assert retrieve(c["bob"], "b", 0, 2) == {(0, 0): payload(100, OBJ), (1, 0): payload(101, OBJ)}


def test_another_tenants_session_id_is_unknown_and_stays_untouched(tenancy):
    _, admin, c, ks, _, _ = tenancy
    store(c["alice"], ks, T1, lambda ch, g: payload(ch, OBJ))
    assert lookup(c["alice"], ks, T1, session=sid("victim")) == 512
    before = admin.call("describe").result["tenants"]["alice"]["sessions"]
    bob = c["bob"]
    assert (
        code_of(lambda: bob.call("retrieve", session=sid("victim"), rank=0, start_chunk=0, end_chunk=2, mode="tcp"))
        == "UNKNOWN_SESSION"
    )
    assert bob.call("release", session=sid("victim")).result["released"] is False
    assert bob.call("release", session=sid("victim"), rank=0, lease=1).result["released"] is False
    assert bob.call("end_session", session=sid("victim")).result["released"] is False
    assert lookup(bob, ks, list(range(9, 9 + 512)), session=sid("victim")) == 0  # his own, separate session
    assert admin.call("describe").result["tenants"]["alice"]["sessions"] == before
    got = alice_reads(c["alice"], "victim")
    assert got == {(0, 0): payload(0, OBJ), (1, 0): payload(1, OBJ)}


def alice_reads(alice: Client, session: str) -> dict:
    session = sid(session)
    reply = alice.call("retrieve", session=session, rank=0, start_chunk=0, end_chunk=2, mode="tcp")
    released = alice.call("release", session=session, rank=0, lease=reply.result["lease"]).result
    assert released == {"released": True, "intact": True}  # her leases were never touched
    return {(o["chunk"], o["group"]): bytes(f) for o, f in zip(reply.result["objects"], reply.frames)}


def test_another_tenants_store_id_is_unknown_and_the_store_stays_intact(tenancy):
    _, admin, c, ks, _, _ = tenancy
    reply = store(c["alice"], ks, T1, lambda ch, g: b"", commit=False)
    store_id_ = reply["store_id"]
    assert store_id_.startswith("st-") and len(store_id_) == 3 + 32  # 128 random bits
    junk = [b"\xee" * OBJ] * 2
    bob = c["bob"]
    assert (
        code_of(lambda: bob.call("commit", frames=junk, store_id=store_id_, checksums=[kvsum64(j) for j in junk]))
        == "UNKNOWN_STORE"
    )
    assert code_of(lambda: bob.call("abort", store_id=store_id_)) == "UNKNOWN_STORE"
    assert code_of(lambda: bob.call("abort", store_id="st-" + "0" * 32)) == "UNKNOWN_STORE"
    assert admin.call("describe").result["tenants"]["alice"]["stores_in_flight"] == 1
    good = [payload(0, OBJ), payload(1, OBJ)]
    alice = c["alice"]
    assert (
        alice.call("commit", frames=good, store_id=store_id_, checksums=[kvsum64(g) for g in good]).result["committed"]
        == 2
    )
    assert lookup(alice, ks, T1, session=sid("s")) == 512
    assert alice_reads(alice, "s") == {(0, 0): good[0], (1, 0): good[1]}


def test_admin_ops_need_the_server_token(tenancy):
    _, admin, c, ks, _, _ = tenancy
    store(c["alice"], ks, T1, lambda ch, g: payload(ch, OBJ))
    assert code_of(lambda: c["bob"].call("clear")) == "FORBIDDEN"
    assert lookup(c["alice"], ks, T1) == 512
    mine = c["bob"].call("describe").result
    assert mine["tenant"] == "bob" and set(mine["tenants"]) == {"bob"} and "engines" not in mine
    assert {"alice", "bob", "carol", "default"} <= set(admin.call("describe").result["tenants"])
    with Client(c["bob"].url, token="kvt-not-a-tenant") as stranger:
        assert code_of(lambda: stranger.call("lookup", keyspace=ks.to_wire(), tokens=pack_tokens(T1))) == "UNAUTHORIZED"


def test_removed_tenant_loses_access_without_a_restart(tenancy):
    _, _, c, ks, _, tenants = tenancy
    assert lookup(c["bob"], ks, T1) == 0
    subprocess.run([str(BIN / "kvserver"), "tenant", "remove", "bob", "--tenants-file", str(tenants)], check=True)

    def refused() -> bool:
        try:
            lookup(c["bob"], ks, T1)
        except ServerError as exc:
            return exc.code == "UNAUTHORIZED"
        return False

    wait_for(refused, timeout=10, what="bob's token to stop working")
    dave = Client(c["bob"].url, token=add_tenant(tenants, "dave"))
    with dave:  # a tenant added while the server runs works at once (an unknown token re-reads the file)
        wait_for(lambda: _works(dave, ks), timeout=10, what="dave's token to work")


def _works(client: Client, ks) -> bool:
    try:
        return lookup(client, ks, T1) == 0
    except ServerError:
        return False


def test_quota_evicts_the_tenants_own_objects_first_then_refuses(tenancy):
    _, admin, c, ks, _, _ = tenancy
    store(c["alice"], ks, T1, lambda ch, g: payload(ch, OBJ))  # another tenant's objects: never evicted for carol
    carol = c["carol"]
    first = list(range(20_000, 20_000 + 512))
    store(carol, ks, first, lambda ch, g: payload(ch, OBJ))
    row = admin.call("describe").result["tenants"]["carol"]
    assert row["l1_used_bytes"] == 2 * OBJ and row["l1_quota_bytes"] == 3 * OBJ
    second = list(range(30_000, 30_000 + 512))  # 2 more objects: one fits, one evicts carol's oldest
    reply = store(carol, ks, second, lambda ch, g: payload(ch, OBJ))
    assert [s["status"] for s in reply["slots"]] == ["reserved", "reserved"]
    row = admin.call("describe").result["tenants"]["carol"]
    assert row["l1_used_bytes"] == 3 * OBJ and row["quota_evictions"] == 1 and row["quota_refusals"] == 0
    # one of her first prompt's objects went (which one is the eviction policy's choice)
    assert lookup(carol, ks, first) < 512 and lookup(carol, ks, second) == 512
    assert lookup(c["alice"], ks, T1) == 512  # alice untouched
    # four chunks at once: three reservations fill the quota (evicting her own), the fourth is refused
    big = list(range(40_000, 40_000 + 4 * 256))
    reply = store(carol, ks, big, lambda ch, g: payload(ch, OBJ))
    assert [s["status"] for s in reply["slots"]] == ["reserved"] * 3 + ["no_space"]
    row = admin.call("describe").result["tenants"]["carol"]
    assert row["l1_used_bytes"] == 3 * OBJ and row["quota_refusals"] == 1
    assert lookup(c["alice"], ks, T1) == 512


def test_session_and_store_caps_are_per_tenant(tenancy):
    _, _, c, ks, _, _ = tenancy
    carol, alice = c["carol"], c["alice"]
    for who in (carol, alice):  # sessions hold the leases of lookups that hit: a miss leaves none
        store(who, ks, T1[:256], lambda ch, g: payload(ch, OBJ))
    assert lookup(carol, ks, T1, session=sid("s1")) == 256
    assert lookup(carol, ks, T1, session=sid("s2")) == 256
    assert lookup(carol, ks, T1, session=sid("s1")) == 256  # an existing session is no new one
    assert code_of(lambda: lookup(carol, ks, T1, session=sid("s3"))) == "TOO_MANY"
    assert lookup(alice, ks, T1, session=sid("s3")) == 256  # other tenants are not affected
    carol.call("end_session", session=sid("s1"))
    assert lookup(carol, ks, T1, session=sid("s3")) == 256
    held = store(carol, ks, list(range(50_000, 50_512)), lambda ch, g: b"", commit=False)
    assert code_of(lambda: store(carol, ks, list(range(60_000, 60_512)), lambda ch, g: b"", commit=False)) == "TOO_MANY"
    store(alice, ks, list(range(60_000, 60_512)), lambda ch, g: payload(ch, OBJ))  # alice still stores
    carol.call("abort", store_id=held["store_id"])
    store(carol, ks, list(range(60_000, 60_512)), lambda ch, g: payload(ch, OBJ))


def test_per_tenant_counters_move_exactly(tenancy):
    srv, admin, c, ks, _, _ = tenancy
    store(c["alice"], ks, T1[:256], lambda ch, g: payload(ch, OBJ))
    before = admin.call("describe").result["tenants"]
    assert lookup(c["alice"], ks, T1, session=sid("x")) == 256  # 512 asked, 256 hit
    retrieve(c["alice"], "x", 0, 1)
    after = admin.call("describe").result["tenants"]
    a0, a1 = before["alice"], after["alice"]
    assert (
        a1["lookups"] - a0["lookups"],
        a1["lookup_tokens"] - a0["lookup_tokens"],
        a1["lookup_hit_tokens"] - a0["lookup_hit_tokens"],
    ) == (1, 512, 256)
    assert (a1["retrieves"] - a0["retrieves"], a1["retrieved_bytes"] - a0["retrieved_bytes"]) == (1, OBJ)
    assert after["bob"] == before["bob"]
    token = srv.http().headers["Authorization"]
    samples = parse_metrics(httpx.get(f"{srv.http_url}/metrics", headers={"Authorization": token}).text)
    assert value(samples, "kvserver_tenant_lookup_tokens_total", tenant="alice") == a1["lookup_tokens"]
    assert value(samples, "kvserver_tenant_lookup_hit_tokens_total", tenant="alice") == a1["lookup_hit_tokens"]
    assert value(samples, "kvserver_tenant_l1_used_bytes", tenant="alice") == OBJ
    assert value(samples, "kvserver_tenant_lookup_tokens_total", tenant="bob") == before["bob"]["lookup_tokens"]


def test_a_malformed_tenants_file_keeps_the_last_good_table_and_is_reported_once(tenancy):
    """A null entry (or a string quota) used to raise on every token check: INTERNAL once a second."""
    srv, _, c, ks, _, tenants = tenancy
    assert lookup(c["alice"], ks, T1) == 0
    good = tenants.read_text()
    for bad in (
        '{"version": 1, "tenants": {"alice": null}}',
        '{"version": 1, "tenants": {"alice": {"token_sha256": "x", "l1_quota_bytes": "lots"}}}',
        "[1, 2]",
    ):
        before = srv.log().count("cannot use tenants file")
        tenants.write_text(bad)
        stamp = time.time() + 5 + len(bad)  # a new mtime per version, even on a coarse clock
        os.utime(tenants, (stamp, stamp))
        wait_for(
            lambda n=before: lookup(c["alice"], ks, T1) == 0 and srv.log().count("cannot use tenants file") > n,
            timeout=10,
            what="the bad file reported",
        )  # token checks re-read the file
        for _ in range(3):  # tenants known before keep working: no INTERNAL
            assert lookup(c["alice"], ks, T1) == 0 and lookup(c["bob"], ks, T1) == 0
    reported = srv.log().count("cannot use tenants file")
    for _ in range(20):  # unknown tokens force re-checks of the (unchanged, bad) file
        with pytest.raises(ServerError):
            Client(srv.url, token="kvt-unknown", timeout=5).call("describe")
    assert srv.log().count("cannot use tenants file") == reported  # once per bad version, not per check
    tenants.write_text(good)
    os.utime(tenants, (time.time() + 10, time.time() + 10))
    assert lookup(c["carol"], ks, T1) == 0


def test_a_tenants_file_another_user_can_write_is_not_trusted(server_factory, tmp_path):
    tenants = tmp_path / "tenants.json"
    token = add_tenant(tenants, "alice")
    os.chmod(tenants, 0o666)
    srv = server_factory("--l1-size-gb", "0.02", "--tenants-file", str(tenants))
    with Client(srv.url, token=token, timeout=5) as alice:
        assert code_of(lambda: alice.call("describe")) == "UNAUTHORIZED"
    assert "writable by other users" in srv.log()
    if os.getuid() == 0:  # a file of another user (mode 0644) is not trusted either
        os.chmod(tenants, 0o644)
        os.chown(tenants, 65534, 65534)
        os.utime(tenants, (time.time() + 5, time.time() + 5))
        wait_for(
            lambda: _probe(srv.url, token) and "belongs to uid 65534" in srv.log(),
            timeout=10,
            what="the foreign file refused",
        )
        with Client(srv.url, token=token, timeout=5) as alice:
            assert code_of(lambda: alice.call("describe")) == "UNAUTHORIZED"
    os.chown(tenants, os.getuid(), os.getgid())
    os.chmod(tenants, 0o600)
    os.utime(tenants, (time.time() + 10, time.time() + 10))
    wait_for(lambda: _describes(srv.url, token), timeout=10, what="the fixed file trusted")


def _probe(url: str, token: str) -> bool:
    """One token check (it re-reads a changed tenants file); True whatever the answer."""
    with Client(url, token=token, timeout=5) as c:
        try:
            c.call("describe")
        except ServerError:
            pass
    return True


def _describes(url: str, token: str) -> bool:
    with Client(url, token=token, timeout=5) as c:
        try:
            return bool(c.call("describe").result)
        except ServerError:
            return False


def test_store_and_abort_in_a_loop_stays_within_the_tenants_quota(tenancy):
    """#34 finding 5: aborted shm stores are quarantined (the writer may still be copying); their
    bytes stay charged to the tenant until freed, so the loop hits carol's own quota (3 objects)
    instead of filling the arena, and alice keeps storing."""
    _, admin, c, ks, _, _ = tenancy
    carol = c["carol"]
    statuses: list[str] = []
    for i in range(12):  # each chunk is a new key: 12 objects, 4x carol's quota
        toks = list(range(60_000 + i * 256, 60_000 + (i + 1) * 256))
        reply = store(carol, ks, toks, lambda ch, g: payload(ch, OBJ), mode="shm", commit=False)
        statuses += [s["status"] for s in reply["slots"]]
        if reply.get("store_id"):
            carol.call("abort", store_id=reply["store_id"])
    assert statuses[:3] == ["reserved"] * 3 and set(statuses[3:]) == {"no_space"}, statuses
    described = admin.call("describe").result
    row = described["tenants"]["carol"]
    assert row["l1_used_bytes"] == 3 * OBJ and row["quota_refusals"] >= 9  # the quarantine is hers
    assert described["l1"]["quarantined_bytes"] == 3 * OBJ
    reply = store(c["alice"], ks, T1, lambda ch, g: payload(ch, OBJ))  # the bystander still stores
    assert [s["status"] for s in reply["slots"]] == ["reserved", "reserved"] and lookup(c["alice"], ks, T1) == 512
