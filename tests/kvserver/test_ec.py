"""The encoder cache namespace: own segment, own budget, LRU within it, leases, checksums, counters.

A real kvserver process; EC objects go in over tcp frames and over the shared-memory segment.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvtestkit.kvhelpers import ArenaMap, payload, register, store, tiny_layout
from kvprotocol import Client, ServerError
from kvprotocol.kvsum import kvsum64

KEY = {"model": "tiny-vlm@0123456789abcdef", "space": "fedcba9876543210"}
MiB = 1 << 20


def ec_put(c: Client, item: str, data: bytes, mode: str = "tcp", **key: Any) -> dict[str, Any]:
    """Store one encoder output; returns ec_store's reply."""
    k = {**KEY, **key}
    r = c.call("ec_store", **k, item=item, dtype="float32", shape=[len(data) // 4], size=len(data), mode=mode).result
    if r["status"] != "reserved":
        return r
    if mode == "tcp":
        c.call("ec_commit", [data], store_id=r["store_id"], checksum=kvsum64(data))
    else:
        seg = ArenaMap(r["arena"]["name"], r["arena"]["size"])
        seg.write(r["offset"], data)
        seg.close()
        c.call("ec_commit", store_id=r["store_id"], checksum=kvsum64(data))
    return r


def ec_get(c: Client, item: str, **key: Any) -> bytes | None:
    r = c.call("ec_retrieve", **{**KEY, **key}, item=item, mode="tcp")
    if not r.result["found"]:
        return None
    data = bytes(r.frames[0])
    assert kvsum64(data) == r.result["checksum"]
    return data


def test_tcp_and_shm_roundtrip_with_checksums(server_factory: Any) -> None:
    srv = server_factory("--l1-size-gb", "0.05", "--ec-size-gb", "0.01")
    with srv.client() as c:
        a, b = payload(1, 300_000), payload(2, 123_456)
        assert ec_put(c, "img-a", a, "tcp")["status"] == "reserved"
        assert ec_put(c, "img-b", b, "shm")["status"] == "reserved"
        assert ec_get(c, "img-a") == a and ec_get(c, "img-b") == b
        assert ec_put(c, "img-a", a, "tcp") == {"status": "present"}  # stored once
        # shm read: the offset under a lease, the bytes read from the mapped segment
        r = c.call("ec_retrieve", **KEY, item="img-b", mode="shm").result
        seg = ArenaMap(r["arena"]["name"], r["arena"]["size"])
        assert seg.read(r["offset"], r["size"]) == b and r["shape"] == [len(b) // 4] and r["dtype"] == "float32"
        seg.close()
        assert c.call("ec_release", lease=r["lease"]).result == {"released": True}
        assert c.call("ec_release", lease=r["lease"]).result == {"released": False}
        # another space (other weights or dtype) or model is another object
        assert ec_get(c, "img-a", space="0000000000000000") is None
        assert ec_get(c, "img-a", model="other") is None
        ec = c.call("describe").result["ec"]
        assert ec["objects"] == 2 and ec["object_bytes"] == len(a) + len(b)
        assert ec["capacity_bytes"] == int(0.01 * (1 << 30)) // 4096 * 4096
        assert ec["arena"].endswith("-ec")
        assert ec["counters"]["deduplicated"] == 1 and ec["counters"]["stores"] == 2


def test_bad_commit_is_refused_and_changes_nothing(server: Any) -> None:
    with server.client() as c:
        data = payload(3, 4096)
        r = c.call("ec_store", **KEY, item="x", dtype="float32", shape=[1024], size=4096, mode="tcp").result
        with pytest.raises(ServerError) as bad:
            c.call("ec_commit", [data], store_id=r["store_id"], checksum=kvsum64(data) ^ 1)
        assert bad.value.code == "BAD_FIELD"
        with pytest.raises(ServerError) as short:
            c.call("ec_commit", [data[:100]], store_id=r["store_id"], checksum=kvsum64(data[:100]))
        assert short.value.code == "BAD_FIELD"
        assert ec_get(c, "x") is None  # nothing readable yet
        c.call("ec_commit", [data], store_id=r["store_id"], checksum=kvsum64(data))  # the store stayed open
        assert ec_get(c, "x") == data
        for fields in ({"items": []}, {"items": ["a b"]}, {"items": ["ok"], "readers": -1}):
            with pytest.raises(ServerError):
                c.call("ec_lookup", **KEY, **fields)
        with pytest.raises(ServerError) as unknown:
            c.call("ec_commit", store_id="nope", checksum=0)
        assert unknown.value.code == "UNKNOWN_STORE"
        assert c.call("ping").result["protocol"] >= 1  # still serving


def test_lru_within_the_ec_budget_and_leases_protect(server_factory: Any) -> None:
    srv = server_factory("--l1-size-gb", "0.05", "--ec-size-gb", str(4 * MiB / (1 << 30)), "--lease-ttl", "30")
    with srv.client() as c:
        blobs = {f"img-{i}": payload(10 + i, MiB) for i in range(3)}
        for item, data in blobs.items():
            ec_put(c, item, data)
        look = c.call("ec_lookup", **KEY, items=["img-0"], readers=1).result["items"][0]  # leased, and now recent
        assert look is not None and "lease" in look
        ec_put(c, "img-3", payload(13, MiB))
        ec_put(c, "img-4", payload(14, MiB))  # over budget: the oldest unleased ones go
        present = c.call("ec_lookup", **KEY, items=[f"img-{i}" for i in range(5)]).result["items"]
        assert present[0] is not None  # leased: never evicted
        assert present[1] is None  # least recently used
        assert present[4] is not None
        counters = c.call("describe").result["ec"]["counters"]
        assert counters["evictions"] >= 1 and counters["hits"] >= 1 and counters["misses"] >= 1
        # every object leased: a store that does not fit gets no_space, nothing is evicted
        leases = [
            x["lease"]
            for x in c.call("ec_lookup", **KEY, items=[f"img-{i}" for i in range(5)], readers=2).result["items"]
            if x is not None
        ]
        big = c.call("ec_store", **KEY, item="big", dtype="uint8", shape=[3 * MiB], size=3 * MiB).result
        assert big == {"status": "no_space"}
        for lease in leases:  # two readers each: the first release keeps the lease
            c.call("ec_release", lease=lease)
        assert c.call("describe").result["ec"]["leases"] == len(leases) + 1
        for lease in leases:
            c.call("ec_release", lease=lease)
        assert c.call("describe").result["ec"]["leases"] == 1


def test_kv_pressure_never_evicts_ec(server_factory: Any) -> None:
    srv = server_factory("--l1-size-gb", str(2 * MiB / (1 << 30)), "--chunk-size", "32")
    with srv.client() as c:
        data = payload(5, 8192)
        ec_put(c, "keep", data)
        layout = tiny_layout(chunk_size=32, layers=2, block_bytes=4096)  # 8 KiB per chunk object
        ks, _ = register(c, "kvmodel", [layout])
        for i in range(8):  # ~2x the L1 arena in KV: L1 evicts, EC does not move
            tokens = [i * 100_000 + t for t in range(32 * 64)]
            store(c, ks, tokens, lambda chunk, group: payload(chunk, layout.object_bytes))
        d = c.call("describe").result
        assert d["l1"]["evictions"] > 0
        assert d["ec"]["counters"]["evictions"] == 0 and ec_get(c, "keep") == data
