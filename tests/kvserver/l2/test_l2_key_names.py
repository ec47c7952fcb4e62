"""The L2 name of every object the server keys: byte-identical to what earlier releases wrote.

An upgraded server must find what an older one stored in a shared or persistent tier, so the names
its key builders (plain keyspaces: leases.rank_keys; geometries: groups.KeyPlan) hand to L2 are
pinned here as literals, taken from the release whose keys were still plain tuples.
"""

from __future__ import annotations

from kvprotocol import SHARED_RANK, KeySpace, LayoutDescriptor, ObjectKey
from kvserver.service.groups import GroupBook
from kvserver.l2.keys import key_str
from kvserver.service.leases import rank_keys

H = bytes(range(32))


def test_plain_keyspace_objects_keep_their_l2_names() -> None:
    ks = KeySpace("org/model-7B", 2, ("0123456789abcdef", "fedcba9876543210"))
    keys = rank_keys(ks, "~acme~tenant-secret", 1, [H])
    assert [type(k) for k in keys] == [ObjectKey, ObjectKey]
    assert [key_str(k) for k in keys] == [
        f"kv1/org/model-7B/0123456789abcdef/w2r1/g0/46030850dc82a4f5/{H.hex()}",
        f"kv1/org/model-7B/fedcba9876543210/w2r1/g1/46030850dc82a4f5/{H.hex()}",
    ]


def test_shared_group_objects_keep_their_l2_names() -> None:
    shared = LayoutDescriptor("vllm_cpu", "float16", 2, 32, 1024, 256, (512,), shared=True)
    book = GroupBook(256)
    book.add(shared)
    plan = book.plan(KeySpace("mla/m", 4, (shared.fingerprint,)))
    assert plan is not None
    (key,) = plan.ending_at("", H, 0)
    assert key.kv_rank == SHARED_RANK
    assert shared.fingerprint == "89c4c042ad03c0b5"
    assert key_str(key) == f"kv1/mla/m/89c4c042ad03c0b5/w4rs/g0/-/{H.hex()}"
