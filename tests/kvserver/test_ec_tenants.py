"""The encoder cache's tenant boundary against a real kvserver: one test per attack of tenant bob on alice.

Tenants are made with the real CLI (`kvserver tenant add`); each client holds only its own token.
Each test runs the attack, asserts it fails, and that alice's encoder outputs still round-trip.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvconnector.ec_client import ECClient
from kvtestkit.kvhelpers import ArenaMap, payload
from kvprotocol import Client, ServerError
from kvprotocol.kvsum import kvsum64
from test_ec import KEY, MiB, ec_get, ec_put
from kvtestkit.tenants import add_tenant

GiB = 1 << 30


@pytest.fixture
def ec_tenancy(server_factory: Any, tmp_path: Path):
    """A 4 MiB EC segment; alice with the defaults (quota: half the segment), bob with a 1 MiB EC quota,
    4 EC stores and 4 EC leases, carol with the defaults (to show the default caps bind). alice and bob
    may use shm mode (the attacks here include shm-mode reads)."""
    tenants = tmp_path / "tenants.json"
    tokens = {
        "alice": add_tenant(tenants, "alice", "--allow-shm"),
        "bob": add_tenant(
            tenants,
            "bob",
            "--ec-quota-gb",
            str(MiB / GiB),
            "--ec-max-stores",
            "4",
            "--ec-max-leases",
            "4",
            "--allow-shm",
        ),
        "carol": add_tenant(tenants, "carol"),
    }
    srv = server_factory(
        "--l1-size-gb", "0.02", "--ec-size-gb", str(4 * MiB / GiB), "--lease-ttl", "30", "--tenants-file", str(tenants)
    )
    clients = {name: Client(srv.url, token=tok) for name, tok in tokens.items()}
    admin = srv.client()
    yield srv, admin, clients, tokens
    for c in clients.values():
        c.close()
    admin.close()


def code_of(fn: Any) -> str:
    with pytest.raises(ServerError) as err:
        fn()
    return str(err.value.code)


def ec_row(admin: Client, tenant: str) -> dict[str, Any]:
    return admin.call("describe").result["tenants"][tenant]


def test_another_tenant_cannot_read_an_item_by_its_id(ec_tenancy: Any) -> None:
    _, admin, c, _ = ec_tenancy
    secret = payload(1, 64 * 1024)
    assert ec_put(c["alice"], "img-x", secret)["status"] == "reserved"
    bob = c["bob"]
    assert bob.call("ec_lookup", **KEY, items=["img-x"], readers=1).result["items"] == [None]
    assert ec_get(bob, "img-x") is None  # tcp: no bytes
    assert bob.call("ec_retrieve", **KEY, item="img-x", mode="shm").result == {"found": False}  # no offset
    assert ec_row(admin, "bob")["ec_leases"] == 0
    assert ec_get(c["alice"], "img-x") == secret  # the owner still reads her bytes
    assert c["alice"].call("ec_lookup", **KEY, items=["img-x"]).result["items"][0]["size"] == len(secret)


def test_a_store_before_the_victim_does_not_poison_its_item(ec_tenancy: Any) -> None:
    srv, _, c, tokens = ec_tenancy
    poison = payload(66, 64 * 1024)
    assert ec_put(c["bob"], "img-p", poison)["status"] == "reserved"  # bob stores first, valid checksum
    # alice's engine (the real ECClient with her token): her store is her own, not 'present'
    engine = ECClient(srv.url, KEY["model"], KEY["space"], mode="tcp", token=tokens["alice"])
    mine = np.random.default_rng(7).standard_normal((128, 128), dtype=np.float32)
    assert engine.save("img-p", mine.view(np.uint8), "float32", list(mine.shape))
    assert engine.stats.present == 0
    got = engine.load("img-p")
    assert got is not None and np.array_equal(got[0].view(np.float32).reshape(got[2]), mine)
    desc = engine.lookup(["img-p"], readers=1)[0]
    assert desc is not None and desc["checksum"] == kvsum64(mine.tobytes())
    engine.release(desc["lease"])
    engine.close()
    assert ec_get(c["bob"], "img-p") == poison  # bob's copy is his own, untouched
    # the same happens for a store bob holds open (writing): alice is not told 'writing'
    r = c["bob"].call("ec_store", **KEY, item="img-w", dtype="uint8", shape=[64], size=64, mode="tcp").result
    assert r["status"] == "reserved"
    assert ec_put(c["alice"], "img-w", payload(3, 4096))["status"] == "reserved"
    assert ec_get(c["alice"], "img-w") == payload(3, 4096)


def test_another_tenants_lease_cannot_be_released(ec_tenancy: Any) -> None:
    _, admin, c, _ = ec_tenancy
    alice, bob = c["alice"], c["bob"]
    data = payload(5, 256 * 1024)
    ec_put(alice, "img-l", data, mode="shm")
    lease = alice.call("ec_lookup", **KEY, items=["img-l"], readers=1).result["items"][0]["lease"]
    assert isinstance(lease, str) and len(lease) >= 22  # 128 random bits, not a counter
    shm = alice.call("ec_retrieve", **KEY, item="img-l", mode="shm").result
    assert shm["lease"] != lease
    for stolen in (lease, shm["lease"], "A" * 22):
        assert bob.call("ec_release", lease=stolen).result == {"released": False}
    assert code_of(lambda: bob.call("ec_release", lease=1)) == "BAD_FIELD"  # the old integer form
    assert ec_row(admin, "alice")["ec_leases"] == 2  # both of alice's leases still hold
    seg = ArenaMap(shm["arena"]["name"], shm["arena"]["size"])
    assert seg.read(shm["offset"], shm["size"]) == data
    seg.close()
    assert alice.call("ec_release", lease=shm["lease"]).result == {"released": True}
    assert alice.call("ec_release", lease=lease).result == {"released": True}
    assert ec_row(admin, "alice")["ec_leases"] == 0


def test_a_small_quota_evicts_only_the_tenants_own_items(ec_tenancy: Any) -> None:
    _, admin, c, _ = ec_tenancy
    alice, bob = c["alice"], c["bob"]
    kept = {f"a-{i}": payload(20 + i, MiB // 2) for i in range(2)}  # 1 MiB: within her quota and fair share
    for item, data in kept.items():
        assert ec_put(alice, item, data)["status"] == "reserved"
    for i in range(12):  # 6 MiB through bob's 1 MiB quota (the segment is 4 MiB)
        assert ec_put(bob, f"b-{i}", payload(40 + i, MiB // 2))["status"] == "reserved"
    assert bob.call("ec_store", **KEY, item="big", dtype="uint8", shape=[2 * MiB], size=2 * MiB).result == {
        "status": "no_space"
    }  # over his quota whatever he evicts
    row = ec_row(admin, "bob")
    assert row["ec_used_bytes"] == MiB and row["ec_quota_bytes"] == MiB
    assert row["ec_quota_evictions"] == 10 and row["ec_quota_refusals"] == 1
    assert ec_row(admin, "alice")["ec_fair_share_evictions"] == 0
    for item, data in kept.items():  # every one of alice's items is still there and intact
        assert ec_get(alice, item) == data
    assert ec_get(bob, "b-11") == payload(51, MiB // 2) and ec_get(bob, "b-0") is None
    # a tenant at the default quota (half the segment) cannot evict alice either: carol fills hers, and
    # with three tenants holding EC bytes, alice's 1 MiB is within her fair share (4 MiB / 3)
    for i in range(8):
        assert ec_put(c["carol"], f"c-{i}", payload(60 + i, MiB // 2))["status"] == "reserved"
    assert ec_row(admin, "carol")["ec_used_bytes"] <= 2 * MiB
    assert all(ec_get(alice, item) == data for item, data in kept.items())
    assert ec_put(alice, "a-new", payload(9, MiB // 4))["status"] == "reserved"  # alice still stores


def test_fair_share_protects_a_tenant_from_an_unlimited_one(ec_tenancy: Any) -> None:
    _, admin, c, _ = ec_tenancy
    alice = c["alice"]
    mine = payload(30, MiB // 2)
    ec_put(alice, "a-0", mine)
    for i in range(16):  # the server's own token has no EC quota: it churns the whole segment
        assert ec_put(admin, f"d-{i}", payload(70 + i, MiB // 2))["status"] == "reserved"
    assert ec_get(alice, "a-0") == mine  # within her fair share: never evicted for another tenant
    # alice's next stores take room from the tenant over its fair share, not from her
    for i in range(1, 4):
        assert ec_put(alice, f"a-{i}", payload(30 + i, MiB // 2))["status"] == "reserved"
    assert all(ec_get(alice, f"a-{i}") == payload(30 + i, MiB // 2) for i in range(4))
    assert ec_row(admin, "default")["ec_fair_share_evictions"] >= 3
    assert ec_row(admin, "alice")["ec_fair_share_evictions"] == 0


def test_one_tenant_cannot_take_every_lease_or_store_slot(ec_tenancy: Any) -> None:
    _, admin, c, _ = ec_tenancy
    alice, bob, carol = c["alice"], c["bob"], c["carol"]
    ec_put(bob, "b-x", payload(1, 4096))
    leased = bob.call("ec_lookup", **KEY, items=["b-x"] * 8, readers=1).result["items"]
    assert sum(x is not None for x in leased) == 4 and leased[4:] == [None] * 4  # his 4-lease cap
    assert code_of(lambda: bob.call("ec_retrieve", **KEY, item="b-x", mode="shm")) == "TOO_MANY"
    opened = [
        bob.call("ec_store", **KEY, item=f"s-{i}", dtype="uint8", shape=[64], size=64, mode="tcp").result
        for i in range(4)
    ]
    assert all(r["status"] == "reserved" for r in opened)
    assert code_of(lambda: bob.call("ec_store", **KEY, item="s-9", dtype="uint8", shape=[64], size=64)) == "TOO_MANY"
    # a tenant with the default caps gets 256 of the server's 1024 store slots, not all of them
    for i in range(256):
        assert (
            carol.call("ec_store", **KEY, item=f"c-{i}", dtype="uint8", shape=[64], size=64, mode="tcp").result[
                "status"
            ]
            == "reserved"
        )
    assert (
        code_of(lambda: carol.call("ec_store", **KEY, item="c-x", dtype="uint8", shape=[64], size=64, mode="tcp"))
        == "TOO_MANY"
    )
    row = ec_row(admin, "carol")
    assert row["ec_stores_in_flight"] == 256 and row["ec_refused_stores"] == 1
    # alice still stores, leases and reads
    data = payload(2, 64 * 1024)
    assert ec_put(alice, "a-x", data)["status"] == "reserved"
    look = alice.call("ec_lookup", **KEY, items=["a-x"] * 3, readers=1).result["items"]
    assert all(x is not None and "lease" in x for x in look)
    assert ec_get(alice, "a-x") == data
    for x in look:
        assert alice.call("ec_release", lease=x["lease"]).result == {"released": True}
    assert ec_row(admin, "bob")["ec_refused_leases"] == 5
