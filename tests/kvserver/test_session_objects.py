"""The session-object budget per tenant (#34 finding 8), against a real kvserver with real tenants.

The attack: one tenant opens sessions of long missed lookups with `rank` (each once kept every chunk
hash) until the server-wide budget is gone and every other tenant's lookup gets TOO_MANY. Now a
lookup is charged for its hit only, and each tenant holds at most its share of the budget.
"""

from __future__ import annotations

from kvtestkit.kvhelpers import lookup, payload, register, retrieve, sid, store, tiny_layout
from kvprotocol import Client, ServerError, pack_tokens
from kvtestkit.tenants import add_tenant

OBJ = tiny_layout().object_bytes
T_ALICE = list(range(5000, 5000 + 512))  # two chunks at the default chunk size
T_BOB = list(range(7000, 7000 + 512))


def alice_round_trip(alice: Client, ks, name: str) -> None:
    """A bystander's whole read: a leased lookup, its bytes, an intact release."""
    assert lookup(alice, ks, T_ALICE, session=name) == 512
    assert retrieve(alice, name, 0, 2) == {(0, 0): payload(0, OBJ), (1, 0): payload(1, OBJ)}
    assert alice.call("release", session=sid(name), rank=0).result == {"released": True, "intact": True}


def test_missed_lookups_hold_nothing_and_leave_the_budget_to_others(server_factory, tmp_path):
    # chunk size 1: a lookup of 65536 tokens names 65536 chunks, the most one request may
    tenants = tmp_path / "tenants.json"
    tokens = {name: add_tenant(tenants, name) for name in ("alice", "mallory")}
    srv = server_factory("--l1-size-gb", "0.05", "--chunk-size", "1", "--tenants-file", str(tenants))
    admin = srv.client()
    alice, mallory = (Client(srv.url, token=tokens[n]) for n in ("alice", "mallory"))
    ks, _ = register(admin, layouts=[tiny_layout(chunk_size=256)])
    store(alice, ks, T_ALICE[:256], lambda ch, g: payload(ch, OBJ))
    miss = pack_tokens(list(range(1 << 16)))
    # 70 missed sessions of 65536 chunks each: 4.6M chunk hashes if kept, past the server's whole
    # budget of 4M (2**22): the attack that left every other tenant TOO_MANY
    for i in range(70):
        reply = mallory.call("lookup", keyspace=ks.to_wire(), tokens=miss, session=sid(f"m{i}"), rank=0).result
        assert reply["hit_chunks"] == 0
    row = admin.call("describe").result["tenants"]["mallory"]
    assert row["sessions"] == 70 and row["session_objects"] == 0 and row["refused_session_objects"] == 0
    got = alice.call("lookup", keyspace=ks.to_wire(), tokens=pack_tokens(T_ALICE[:256]), session=sid("a"), rank=0)
    assert got.result["hit_chunks"] == 256
    # her hit holds its 256 unit hashes and the one object that ends at the last unit
    assert admin.call("describe").result["tenants"]["alice"]["session_objects"] == 256 + 1
    for c in (alice, mallory, admin):
        c.close()


def test_a_tenant_holds_at_most_its_share_while_another_keeps_reading(server_factory, tmp_path):
    tenants = tmp_path / "tenants.json"
    tokens = {"alice": add_tenant(tenants, "alice"), "bob": add_tenant(tenants, "bob", "--max-session-objects", "600")}
    srv = server_factory("--l1-size-gb", "0.05", "--tenants-file", str(tenants))
    admin = srv.client()
    alice, bob = (Client(srv.url, token=tokens[n]) for n in ("alice", "bob"))
    ks, _ = register(admin)
    store(alice, ks, T_ALICE, lambda ch, g: payload(ch, OBJ))
    store(bob, ks, T_BOB, lambda ch, g: payload(50 + ch, OBJ))
    held = 0
    for i in range(200):  # each session holds 2 chunk hashes + 2 leased keys of bob's own hit
        try:
            assert lookup(bob, ks, T_BOB, session=f"b{i}") == 512
        except ServerError as exc:
            assert str(exc.code) == "TOO_MANY" and "600 objects" in str(exc)
            break
        held += 4
        if i % 20 == 0:  # alice reads whole while bob fills his share
            alice_round_trip(alice, ks, f"a{i}")
    assert held == 600
    rows = admin.call("describe").result["tenants"]
    assert rows["bob"]["session_objects"] == 600 and rows["bob"]["max_session_objects"] == 600
    assert rows["bob"]["refused_session_objects"] == 1
    assert rows["alice"]["max_session_objects"] == 1 << 20  # the default share: a quarter of 4M
    # at his share, a miss still gets its session (it holds nothing), and alice still reads
    assert lookup(bob, ks, list(range(90000, 90512)), session="b-miss") == 0
    alice_round_trip(alice, ks, "a-last")
    # bob ending sessions gets him room again
    assert bob.call("end_session", session=sid("b0")).result["released"] is True
    assert lookup(bob, ks, T_BOB, session="b-again") == 512
    for c in (alice, bob, admin):
        c.close()


def test_sessions_of_misses_end_cleanly_in_any_order(server_factory, tmp_path):
    """Readers of a miss (a lookup with `rank`, or a blend lookup that matched nothing) hold nothing
    and are never counted: ending several of them (release, end, a later lookup replacing one) must
    not fail the server's bookkeeping (it once answered INTERNAL from the second on), and a hit's
    charge still comes and goes exactly."""
    tenants = tmp_path / "tenants.json"
    token = add_tenant(tenants, "mallory")
    srv = server_factory("--l1-size-gb", "0.05", "--lease-ttl", "30", "--tenants-file", str(tenants))
    admin = srv.client()
    mallory = Client(srv.url, token=token)
    ks, _ = register(admin)
    store(mallory, ks, T_BOB[:256], lambda ch, g: payload(ch, OBJ))

    def look(tokens: list[int], name: str) -> int:
        fields = {"keyspace": ks.to_wire(), "tokens": pack_tokens(tokens), "session": sid(name), "rank": 0}
        return int(mallory.call("lookup", **fields).result["hit_tokens"])

    for name in ("m1", "m2", "m3", "m4"):
        assert look(T_ALICE, name) == 0  # misses: each session keeps a reader holding nothing
    mallory.call("release", session=sid("m1"), rank=0)
    mallory.call("end_session", session=sid("m2"))
    assert look(T_BOB, "h1") == 256  # a hit: charged
    assert look(T_BOB, "m3") == 256  # replaces a miss's reader with a hit's
    mallory.call("end_session", session=sid("h1"))
    mallory.call("end_session", session=sid("m3"))
    row = admin.call("describe").result["tenants"]["mallory"]
    assert row["session_objects"] == 0 and row["sessions"] == 1  # m4 is left, holding nothing
    assert look(T_BOB, "h2") == 256  # the server still serves her
    for c in (mallory, admin):
        c.close()
