"""The adapter contract against real backing stores: a directory, redis-server, a Redis Cluster of
three redis-server processes, and a moto S3 server process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import redis
from kvserver.l2 import L2Adapter, L2Error, make_adapter, redact
from kvserver.l2.base import BlobParts, LazyBlob
from kvserver.l2.redis_store import _pack_sets
from l2util import S3_ENV

BACKENDS = ["fs", "redis", "redis-cluster", "s3"]


@pytest.fixture(params=BACKENDS)
async def adapter(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    kind = request.param
    if kind == "fs":
        url = f"fs://{tmp_path}/l2"
    elif kind == "redis":
        url = request.getfixturevalue("redis_server").url
    elif kind == "redis-cluster":
        url = request.getfixturevalue("redis_cluster").url
    else:
        for k, v in S3_ENV.items():
            monkeypatch.setenv(k, v)
        url = request.getfixturevalue("moto_s3").url(request.getfixturevalue("s3_bucket"))
    a = make_adapter(url)
    await a.start()
    yield a
    await a.close()


def _key(i: int) -> str:
    return f"kv1/model/0123456789abcdef/w1r0/g0/-/{i:064x}"


async def test_put_get_contains_delete_usage(adapter: L2Adapter) -> None:
    blobs = {_key(i): os.urandom(1000 + i) for i in range(20)}
    assert await adapter.contains(list(blobs)) == [False] * 20
    assert await adapter.get([_key(0)]) == [None]
    await adapter.put(list(blobs.items()))
    probe = [_key(3), _key(99), _key(7)]
    assert await adapter.contains(probe) == [True, False, True]
    got = await adapter.get(probe)
    assert got[0] == blobs[_key(3)] and got[1] is None and got[2] == blobs[_key(7)]
    usage = await adapter.usage()
    assert usage.objects == 20
    assert usage.bytes > 0
    await adapter.put([(_key(3), b"replaced")])  # the same key means the same bytes, but overwrite works
    assert await adapter.get([_key(3)]) == [b"replaced"]
    await adapter.delete([_key(3), _key(4), _key(99)])
    assert await adapter.contains([_key(3), _key(4), _key(5)]) == [False, False, True]
    assert (await adapter.usage()).objects == 18


async def test_blobs_given_as_parts_read_back_joined(adapter: L2Adapter) -> None:
    """put_parts: a header and a body (a view of a larger buffer, as an L1 slot is), one of them
    encoded lazily; a single Redis node sends the parts without joining them (redis_store.py)."""
    arena = bytearray(os.urandom(3 << 20))
    bodies = [memoryview(arena)[i << 20 : (i + 1) << 20] for i in range(3)]
    heads = [os.urandom(64) for _ in range(3)]
    items: list[tuple[str, BlobParts | LazyBlob]] = [
        (_key(0), (heads[0], bodies[0])),
        (_key(1), LazyBlob(lambda: (heads[1], bodies[1]))),
        (_key(2), (heads[2], bodies[2][:1000])),
    ]
    await adapter.put_parts(items)
    got = await adapter.get([_key(0), _key(1), _key(2), _key(3)])
    assert got[:3] == [heads[0] + bytes(bodies[0]), heads[1] + bytes(bodies[1]), heads[2] + bytes(bodies[2][:1000])]
    assert got[3] is None
    assert (await adapter.usage()).objects == 3


async def test_a_redis_ttl_applies_to_writes_of_parts(redis_server) -> None:  # type: ignore[no-untyped-def]
    a = make_adapter(redis_server.url + "?ttl=100&prefix=ttl/")
    await a.start()
    try:
        await a.put_parts([(_key(5), (b"h" * 64, memoryview(b"b" * 5000)))])
        assert await a.get([_key(5)]) == [b"h" * 64 + b"b" * 5000]
    finally:
        await a.close()
    r = redis.Redis.from_url(redis_server.url)
    assert 90 <= r.ttl("ttl/" + _key(5)) <= 100


async def test_empty_batches_are_no_ops(adapter: L2Adapter) -> None:
    assert await adapter.get([]) == []
    assert await adapter.contains([]) == []
    await adapter.put([])
    await adapter.put_parts([])
    await adapter.delete([])


async def test_unreachable_redis_raises_l2error_quickly() -> None:
    from kvtestkit.serverproc import free_port

    a = make_adapter(f"redis://127.0.0.1:{free_port()}/0?timeout=0.5")
    await a.start()
    with pytest.raises(L2Error, match="redis"):
        await a.contains([_key(1)])
    with pytest.raises(L2Error):
        await a.put([(_key(1), b"x")])
    await a.close()


def test_fs_object_paths_never_follow_key_text(tmp_path: Path) -> None:
    a = make_adapter(f"fs://{tmp_path}/l2")
    path = a.path_of("kv1/../../../etc/passwd/0/-/00")  # type: ignore[attr-defined]
    assert path.is_relative_to(tmp_path / "l2" / "objects")
    assert ".." not in path.parts


@pytest.mark.parametrize(
    "url, message",
    [
        ("ftp://x/y", "scheme must be one of"),
        ("fs://", "needs a directory"),
        ("redis://127.0.0.1:6379/0?bogus=1", "unknown options"),
        ("redis://127.0.0.1:6379/0?ttl=-5", "ttl must be a positive number"),
        ("redis://127.0.0.1:6379/abc", "database number"),
        ("redis+cluster://127.0.0.1:7000/3", "only database 0"),
        ("s3:///prefix", "needs a bucket"),
        ("redis://:hunter2@127.0.0.1:6379/0?nope=1", "unknown options"),
    ],
)
def test_bad_urls_are_refused_clearly(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        make_adapter(url)
    assert "hunter2" not in str(info.value)


def test_redact_removes_only_the_password() -> None:
    assert redact("redis://user:secret@10.0.0.1:6379/2?ttl=5") == "redis://user@10.0.0.1:6379/2?ttl=5"
    assert redact("redis://:secret@h:1/0") == "redis://h:1/0"
    assert redact("fs:///var/cache/kv") == "fs:///var/cache/kv"
    assert "secret" not in make_adapter("redis://:secret@127.0.0.1:6379/0").url


def test_a_set_of_parts_is_packed_without_copying_the_body() -> None:
    slot = bytearray(b"x" * 4096)
    body = memoryview(slot)[100:2100]
    packed = _pack_sets("p/", 7, [("k", (b"H" * 64, body))])
    views = [p for p in packed if isinstance(p, memoryview)]
    assert len(views) == 1 and views[0].obj is slot and len(views[0]) == 2000  # the slot itself, not a copy
    wire = b"".join(bytes(p) for p in packed)
    head = b"*5\r\n$3\r\nSET\r\n$3\r\np/k\r\n$2064\r\n"
    assert wire == head + b"H" * 64 + b"x" * 2000 + b"\r\n$2\r\nEX\r\n$1\r\n7\r\n"
