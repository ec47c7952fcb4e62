"""Warm restart of the encoder cache's segment: a server killed with `kill -9` and started again on the
same port re-adopts its committed encoder outputs (dtype and shape included), verified before they
serve; writes in flight, evicted objects, corrupt bytes and a segment of another size are not."""

from __future__ import annotations

from typing import Any

from kvtestkit.kvhelpers import ArenaMap
from kvprotocol import Client
from kvprotocol.kvsum import kvsum64
from test_ec import KEY, MiB, ec_get, ec_put
from test_warm_restart import adopted

EC_MB = 4
SIZE = ("--l1-size-gb", "0.02", "--ec-size-gb", str(EC_MB * MiB / (1 << 30)), "--lease-ttl", "30")


def image(i: int, size: int = 2000 * 256) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(256)) * (size // 256)


def ec_offset(c: Client, item: str) -> int:
    r = c.call("ec_retrieve", **KEY, item=item, mode="shm").result
    c.call("ec_release", lease=r["lease"])
    return int(r["offset"])


def test_kill9_then_restart_serves_committed_encoder_outputs(server_factory: Any) -> None:
    srv = server_factory(*SIZE)
    with srv.client() as c:
        for i in range(9):  # 9 x ~0.49 MiB in a 4 MiB segment: the LRU evicts img-0 for img-8, and only it
            ec_put(c, f"img-{i}", image(i), mode="shm" if i % 2 else "tcp")
        assert ec_get(c, "img-0") is None
        reserved = c.call("ec_store", **KEY, item="late", dtype="uint8", shape=[1024], size=1024).result
        assert reserved["status"] == "reserved"  # in flight at the kill, never committed
        before = c.call("ec_lookup", **KEY, items=[f"img-{i}" for i in range(1, 9)]).result["items"]
    srv.kill()
    again = server_factory(*SIZE, port=srv.port)
    warm = adopted(again)["ec"]
    assert warm["adopted_arena"] and warm["adopted"] == warm["verified"] == 8 and warm["rejected"] == 0
    with again.client() as c:
        for i in range(1, 9):
            assert ec_get(c, f"img-{i}") == image(i)
        after = c.call("ec_lookup", **KEY, items=[f"img-{i}" for i in range(1, 9)]).result["items"]
        fields = ("dtype", "shape", "size", "checksum")  # what an engine needs to rebuild the tensor
        assert [[x[f] for f in fields] for x in after] == [[x[f] for f in fields] for x in before]
        assert ec_get(c, "img-0") is None  # evicted before the kill: its FREE record holds
        assert ec_get(c, "late") is None  # the write in flight is forgotten, its range usable again
        ec_put(c, "late", image(99, 1024))
        assert ec_get(c, "late") == image(99, 1024)
        r = c.call("ec_retrieve", **KEY, item="img-1", mode="shm").result  # a new nonce, the same bytes
        seg = ArenaMap(r["arena"]["name"], r["arena"]["size"])
        assert kvsum64(seg.read(r["offset"], r["size"])) == r["checksum"]
        seg.close()
        assert c.call("describe").result["ec"]["objects"] == 9


def test_encoder_outputs_corrupted_while_down_are_never_served(server_factory: Any) -> None:
    srv = server_factory(*SIZE)
    with srv.client() as c:
        for i in range(3):
            ec_put(c, f"img-{i}", image(i))
        where = ec_offset(c, "img-1")
    srv.kill()
    with open(f"{srv.arena_path}-ec", "r+b") as f:  # one flipped byte in img-1
        f.seek(where + 1000)
        byte = f.read(1)
        f.seek(where + 1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    again = server_factory(*SIZE, port=srv.port)
    warm = adopted(again)["ec"]
    assert warm["verified"] == 2 and warm["rejected"] == 1
    with again.client() as c:
        assert ec_get(c, "img-0") == image(0) and ec_get(c, "img-2") == image(2)
        assert ec_get(c, "img-1") is None  # freed: a new store of it works
        ec_put(c, "img-1", image(1))
        assert ec_get(c, "img-1") == image(1)


def test_a_segment_of_another_size_starts_empty_and_l1_is_still_adopted(server_factory: Any) -> None:
    srv = server_factory(*SIZE)
    with srv.client() as c:
        ec_put(c, "img-0", image(0))
    srv.kill()
    bigger = ("--l1-size-gb", "0.02", "--ec-size-gb", str(2 * EC_MB * MiB / (1 << 30)), "--lease-ttl", "30")
    again = server_factory(*bigger, port=srv.port)
    assert "-ec: not adopted (its size is" in again.log()
    warm = adopted(again)
    assert warm["adopted_arena"] and not warm["ec"]["adopted_arena"]
    with again.client() as c:
        assert ec_get(c, "img-0") is None
        assert c.call("describe").result["ec"]["objects"] == 0
