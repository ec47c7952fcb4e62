"""Layout registrations and the engine table are bounded per tenant (#34: one tenant registered 96k
layouts and pushed other tenants' engines out of the shared table).

A real server with tenants made by the real CLI: mallory registers layouts and engines past her caps
and is refused (TOO_MANY) or pushes out only her own entries; alice's registration, stores and
lookups keep working, and her objects stay.
"""

from __future__ import annotations

import os
import socket

import pytest

from kvtestkit.kvhelpers import lookup, payload, register, store, tiny_layout
from kvprotocol import Client, KeySpace, ServerError
from kvtestkit.tenants import add_tenant

PER_TENANT_LAYOUTS, PER_TENANT_ENGINES = 256, 64  # service/layouts.py, service/engines.py defaults
TOKENS = list(range(9000, 9000 + 512))


def layouts(first: int, n: int) -> list:
    return [tiny_layout(layers=first + i) for i in range(n)]  # distinct fingerprints


def register_raw(c: Client, groups: list, **extra: object) -> dict:
    return c.call("register_engine", model="m", world_size=1, rank=0, groups=[g.to_wire() for g in groups], **extra)


@pytest.fixture
def pair(server_factory, tmp_path):
    tenants = tmp_path / "tenants.json"
    alice_token, mallory_token = add_tenant(tenants, "alice"), add_tenant(tenants, "mallory")
    srv = server_factory("--l1-size-gb", "0.05", "--tenants-file", str(tenants))
    alice, mallory = Client(srv.url, token=alice_token), Client(srv.url, token=mallory_token)
    with alice, mallory, srv.client() as admin:
        yield admin, alice, mallory


def test_a_tenant_past_its_layout_and_engine_caps_pushes_out_only_its_own(pair) -> None:
    admin, alice, mallory = pair
    here = {"host": socket.gethostname(), "pid": os.getpid()}  # a live local process: never expires here
    alice_engine = register_raw(alice, [tiny_layout()], **here).result["engine_id"]
    ks = KeySpace.from_layouts("m", 1, [tiny_layout()])
    store(alice, ks, TOKENS, lambda ch, g: payload(ch, tiny_layout().object_bytes))

    # the same process fields from another tenant do not take alice's entry over
    assert register_raw(mallory, [tiny_layout()], **here).result["engine_id"] != alice_engine

    for first in (10, 74, 138):  # 64 layouts per registration (the most one may carry)
        register_raw(mallory, layouts(first, 64))
    register_raw(mallory, layouts(202, PER_TENANT_LAYOUTS - 3 * 64 - 1))  # her cap, with the shared one
    with pytest.raises(ServerError) as refused:
        register_raw(mallory, layouts(1000, 1))
    assert refused.value.code == "TOO_MANY" and "layouts" in str(refused.value)
    described = admin.call("describe").result
    assert described["layouts"]["refused"] == 1
    assert described["layouts"]["registered"] == PER_TENANT_LAYOUTS  # alice's one is among hers

    for _ in range(PER_TENANT_ENGINES + 36):  # remote-looking engines (no pid): they stay until the TTL
        register_raw(mallory, [tiny_layout()])  # a layout she holds already
    engines = admin.call("describe").result["engines"]
    assert sum(e["tenant"] == "mallory" for e in engines) == PER_TENANT_ENGINES
    assert [e["id"] for e in engines if e["tenant"] == "alice"] == [alice_engine]

    # her layout-heavy engines were pushed out: their layouts are forgotten when she needs room
    register_raw(mallory, layouts(1000, 64))
    assert admin.call("describe").result["layouts"]["forgotten"] >= 64

    # alice: registers again, stores and looks up; her earlier objects still hit
    ks2, _ = register(alice, layouts=[tiny_layout(layers=3)])
    store(alice, ks2, TOKENS, lambda ch, g: payload(ch, tiny_layout(layers=3).object_bytes))
    assert lookup(alice, ks2, TOKENS) == 512
    assert lookup(alice, ks, TOKENS) == 512
