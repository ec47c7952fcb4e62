"""shm mode is refused to tenants not allowed it (#34 finding 10), against a real kvserver process.

An shm client maps the whole arena, and an shm store it never writes would commit a freed slot's
stale bytes (another tenant's). Tenant bob (made with the real CLI, no `--allow-shm`) runs the attack;
alice (`--allow-shm`) and the server's own token keep their shm data plane.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvtestkit.kvhelpers import ArenaMap, lookup, payload, register, retrieve, sid, store, tiny_layout
from kvprotocol import Client, ServerError, pack_tokens
from kvprotocol.kvsum import kvsum64
from test_ec import KEY, ec_get, ec_put
from kvtestkit.tenants import add_tenant
from test_tenants import BIN

OBJ = tiny_layout().object_bytes
SECRET = list(range(7000, 7000 + 256))  # one chunk of alice's
PROBE = list(range(9000, 9000 + 256))  # one chunk of bob's


@pytest.fixture
def shm_tenancy(server_factory: Any, tmp_path: Path):
    tenants = tmp_path / "tenants.json"
    tokens = {"alice": add_tenant(tenants, "alice", "--allow-shm"), "bob": add_tenant(tenants, "bob")}
    srv = server_factory("--l1-size-gb", "0.02", "--lease-ttl", "30", "--tenants-file", str(tenants), http=True)
    clients = {name: Client(srv.url, token=tok) for name, tok in tokens.items()}
    admin = srv.client()
    yield srv, admin, clients, tenants
    for c in clients.values():
        c.close()
    admin.close()


def code_of(fn: Any) -> str:
    with pytest.raises(ServerError) as err:
        fn()
    return str(err.value.code)


def test_a_tenant_without_shm_is_told_no_arena_and_refused_every_shm_op(shm_tenancy: Any) -> None:
    _, admin, c, _ = shm_tenancy
    alice, bob = c["alice"], c["bob"]
    ks, reg_bob = register(bob)
    assert reg_bob["arena"] == {"name": "", "size": 0, "nonce": ""}  # nothing to map: use tcp
    _, reg_alice = register(alice)
    arena = reg_alice["arena"]
    assert arena["name"] and arena["size"] > 0
    tokens = pack_tokens(PROBE)
    refused = {
        "store": lambda: bob.call("store", keyspace=ks.to_wire(), tokens=tokens, rank=0, mode="shm"),
        "store (default mode)": lambda: bob.call("store", keyspace=ks.to_wire(), tokens=tokens, rank=0),
        "retrieve": lambda: bob.call("retrieve", session=sid("bob-s"), rank=0, start_chunk=0, end_chunk=1),
        "blend_store": lambda: bob.call("blend_store", keyspace=ks.to_wire(), tokens=tokens, rank=0, mode="shm"),
        "ec_store": lambda: bob.call("ec_store", **KEY, item="x", dtype="uint8", shape=[64], size=64, mode="shm"),
        "ec_retrieve": lambda: bob.call("ec_retrieve", **KEY, item="x", mode="shm"),
    }
    for op, fn in refused.items():
        with pytest.raises(ServerError) as err:
            fn()
        assert str(err.value.code) == "FORBIDDEN", (op, err.value)
    row = admin.call("describe").result["tenants"]["bob"]
    assert row["allow_shm"] is False and row["l1_used_bytes"] == 0  # nothing was reserved
    assert bob.call("describe").result["tenants"]["bob"]["allow_shm"] is False
    assert admin.call("describe").result["tenants"]["alice"]["allow_shm"] is True
    # EC lookups name no segment and no offsets for bob
    ec_put(bob, "img", payload(3, 256))
    looked = bob.call("ec_lookup", **KEY, items=["img"], readers=1).result
    assert looked["arena"]["name"] == "" and "offset" not in looked["items"][0]
    assert ec_get(bob, "img") == payload(3, 256)  # tcp keeps working
    # bob's whole data plane over tcp still works
    store(bob, ks, PROBE, lambda ch, g: payload(ch + 50, OBJ))
    assert lookup(bob, ks, PROBE, session="bob-tcp") == 256
    assert retrieve(bob, "bob-tcp", 0, 1) == {(0, 0): payload(50, OBJ)}
    # alice (allowed) and the server's own token keep shm
    view = ArenaMap(arena["name"], arena["size"])
    try:
        store(alice, ks, SECRET, lambda ch, g: payload(ch + 7, OBJ), mode="shm", arena=view)
        assert lookup(alice, ks, SECRET, session="alice-s") == 256
        assert retrieve(alice, "alice-s", 0, 1, mode="shm", arena=view) == {(0, 0): payload(7, OBJ)}
        store(admin, ks, PROBE, lambda ch, g: payload(ch + 9, OBJ), mode="shm", arena=view)
    finally:
        view.close()


def test_stale_bytes_of_a_freed_slot_never_reach_another_tenant(shm_tenancy: Any) -> None:
    """The attack: alice's object is freed (clear), bob reserves in shm mode, writes nothing, commits a
    checksum and retrieves over tcp. Refused now; his tcp store must carry every byte of every slot."""
    _, admin, c, _ = shm_tenancy
    alice, bob = c["alice"], c["bob"]
    ks, _ = register(admin)
    secret = payload(11, OBJ)
    store(alice, ks, SECRET, lambda ch, g: secret)
    assert admin.call("clear").result["removed"] >= 1  # alice's slot is free, its bytes still there
    for _ in range(8):
        assert code_of(
            lambda: bob.call("store", keyspace=ks.to_wire(), tokens=pack_tokens(PROBE), rank=0, mode="shm")
        ) == ("FORBIDDEN")
    reply = bob.call("store", keyspace=ks.to_wire(), tokens=pack_tokens(PROBE), rank=0, mode="tcp").result
    store_id = reply["store_id"]
    assert code_of(lambda: bob.call("commit", store_id=store_id, checksums=[kvsum64(secret)])) == "BAD_FIELD"
    assert code_of(lambda: bob.call("commit", [b"x" * 8], store_id=store_id, checksums=[0])) == "BAD_FIELD"
    assert lookup(bob, ks, PROBE) == 0  # no commit went through
    bob.call("commit", [payload(12, OBJ)], store_id=store_id, checksums=[kvsum64(payload(12, OBJ))])
    assert lookup(bob, ks, PROBE, session="bob-read") == 256
    got = retrieve(bob, "bob-read", 0, 1)[(0, 0)]
    assert got == payload(12, OBJ) and got != secret
    store(alice, ks, SECRET, lambda ch, g: secret)  # the bystander keeps storing and reading
    assert lookup(alice, ks, SECRET, session="alice-read") == 256
    assert retrieve(alice, "alice-read", 0, 1) == {(0, 0): secret}


def test_tenant_add_allow_shm_is_kept_in_the_file_and_listed(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.json"
    add_tenant(tenants, "alice", "--allow-shm")
    add_tenant(tenants, "bob")
    out = subprocess.run(
        [str(BIN / "kvserver"), "tenant", "list", "--tenants-file", str(tenants)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = {line.split("\t")[0]: line for line in out.splitlines()}
    assert "shm=allowed" in rows["alice"] and "shm=no" in rows["bob"]
    assert '"allow_shm": true' in tenants.read_text()
