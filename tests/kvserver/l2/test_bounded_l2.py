"""Bounded L2 through real kvserver processes: fs capacity with eviction by access and an index
rebuilt at start, Redis key prefix with usage from its own keys and TTLs, the negative cache, and
second-hit admission."""

from __future__ import annotations

from pathlib import Path

from kvtestkit.kvhelpers import lookup, register, store
from kvserver.l2.serde import HEADER_BYTES
from l2util import SIZE, data, object_keys, prompt, tier, wait_tier, wait_until

L1 = ("--l1-size-gb", "0.02")
BLOB = SIZE + HEADER_BYTES  # object bytes plus the serde header (no compression)


def _files(root: Path) -> list[Path]:
    return [p for p in (root / "objects").rglob("*") if p.is_file()]


def _fs(root: Path, objects: float) -> str:
    return f"fs://{root}?capacity_gb={objects * BLOB / (1 << 30)!r}"


def test_fs_capacity_evicts_by_access_and_rebuilds_its_index(server_factory, tmp_path: Path) -> None:
    root = tmp_path / "l2"
    s = server_factory(*L1, "--l2", _fs(root, 10.5))  # room for ten objects
    a, b, c_, d = (prompt(4, seed=i) for i in (1, 2, 3, 4))
    with s.client() as c:
        ks, _ = register(c)
        for n, toks in enumerate((a, b), start=1):
            store(c, ks, toks, data(n))
            wait_tier(c, "puts", 4 * n)
        store(c, ks, c_, data(3))
        wait_tier(c, "puts", 12)
        t = wait_until(lambda: (t := tier(c))["objects"] == 10 and t, what="usage from the index")
        assert t["bytes"] == 10 * BLOB and len(_files(root)) == 10  # a's two oldest files went: its tail
        c.call("clear")
        assert lookup(c, ks, a) == 2 * 256  # a's head still serves
        c.call("clear")
        assert lookup(c, ks, b) == 4 * 256  # read from L2: b becomes the most recently used there
        store(c, ks, d, data(4))
        wait_tier(c, "puts", 16)
        wait_until(lambda: len(_files(root)) == 10, what="fs eviction")
        c.call("clear")
        assert lookup(c, ks, b) == 4 * 256  # kept: used after c was written
        assert lookup(c, ks, c_) == 0  # the least recently used: written, never read
        assert lookup(c, ks, a) == 2 * 256  # its head was read back after c was written
    s.stop()
    s2 = server_factory(*L1, "--l2", _fs(root, 6.5))  # smaller: the rebuilt index evicts at start
    with s2.client() as c:
        register(c)
        t = wait_until(lambda: (t := tier(c))["objects"] is not None and t, what="usage")
        assert t["objects"] == 6 and t["bytes"] == 6 * BLOB
        assert len(_files(root)) == 6


def test_redis_prefix_usage_counts_only_own_keys_and_ttl(server_factory, redis_server) -> None:
    tokens = prompt(3, seed=5)
    with redis_server.client() as r:
        r.set("someone-else", b"x" * 100_000)
        r.set("kv1/not-under-our-prefix", b"y" * 1000)
    a = server_factory(*L1, "--l2", redis_server.url + "?prefix=node-a:&ttl=100")
    b = server_factory(*L1, "--l2", redis_server.url + "?prefix=node-b:")
    with a.client() as c:
        ks, _ = register(c)
        store(c, ks, tokens, data(5))
        wait_tier(c, "puts", 3)
        t = wait_until(lambda: (t := tier(c))["objects"] == 3 and t, what="usage of own keys")
        assert t["bytes"] == 3 * BLOB
    with redis_server.client() as r:
        keys = ["node-a:" + k for k in object_keys(ks, tokens)]
        assert r.exists(*keys) == 3
        assert all(0 < r.ttl(k) <= 100 for k in keys)
    with b.client() as c:  # another prefix: another cache in the same database
        register(c)
        assert lookup(c, ks, tokens) == 0
        assert wait_until(lambda: (t := tier(c))["objects"] is not None and t)["objects"] == 0


def test_negative_cache_spares_round_trips_and_forgets_own_writes(server_factory, tmp_path: Path) -> None:
    s = server_factory(*L1, "--l2", f"fs://{tmp_path}/l2", "--l2-negative-ttl", "60")
    tokens = prompt(4, seed=7)
    with s.client() as c:
        ks, _ = register(c)
        assert lookup(c, ks, tokens) == 0
        asked = tier(c)["misses"]
        assert asked == 4
        for _ in range(3):
            assert lookup(c, ks, tokens) == 0
        queue = c.call("describe").result["l2_queue"]
        assert tier(c)["misses"] == asked + 12  # still counted as misses ...
        assert queue["negative_cache_hits"] == 12 and queue["negative_cache"] == 4  # ... without asking
        store(c, ks, tokens, data(7))  # our own write makes the tier hold them: forgotten at once
        wait_tier(c, "puts", 4)
        c.call("clear")
        assert lookup(c, ks, tokens) == 4 * 256


def test_second_hit_admission_skips_one_hit_wonders(server_factory, tmp_path: Path) -> None:
    s = server_factory("--l1-size-gb", "0.001", "--l2", f"fs://{tmp_path}/l2", "--l2-admission", "second-hit")
    reused, once = prompt(4, seed=8), prompt(4, seed=9)
    with s.client() as c:
        ks, _ = register(c)
        store(c, ks, reused, data(8))
        store(c, ks, once, data(9))
        adm = c.call("describe").result["l2_queue"]["admission"]
        assert (adm["mode"], adm["deferred"], adm["admitted"], adm["pending"]) == ("second-hit", 8, 0, 8)
        assert lookup(c, ks, reused) == 4 * 256  # the second use: written now
        wait_tier(c, "puts", 4)
        for seed in range(20, 40):  # push everything out of the 64-object L1
            store(c, ks, prompt(4, seed=seed), data(seed))
        adm = c.call("describe").result["l2_queue"]["admission"]
        assert adm["admitted"] == 4 and adm["forgotten"] >= 4
        assert tier(c)["puts"] == 4
        c.call("clear")
        assert lookup(c, ks, reused) == 4 * 256  # from L2
        assert lookup(c, ks, once) == 0  # never written


def test_tinylfu_admission_writes_an_object_seen_before(server_factory, tmp_path: Path) -> None:
    s = server_factory("--l1-size-gb", "0.001", "--l2", f"fs://{tmp_path}/l2", "--l2-admission", "tinylfu")
    back = prompt(4, seed=50)
    with s.client() as c:
        ks, _ = register(c)
        store(c, ks, back, data(50))  # first time: held back
        for seed in range(60, 80):  # evicted from L1 before anyone asked for it
            store(c, ks, prompt(4, seed=seed), data(seed))
        assert lookup(c, ks, back) == 0 and tier(c)["puts"] == 0
        store(c, ks, back, data(50))  # recomputed and stored again: seen before, written at once
        wait_tier(c, "puts", 4)
        c.call("clear")
        assert lookup(c, ks, back) == 4 * 256
