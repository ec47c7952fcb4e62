"""Shared tiers through real kvserver processes: two servers on one redis-server, on a 3-node Redis
Cluster and on a moto S3 server; damaged Redis values; wrong encryption keys; Redis going away and
coming back; a hung Redis never hangs a lookup."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvtestkit.kvhelpers import lookup, register, retrieve, store, sid
from l2util import S3_ENV, data, object_keys, prompt, tier, wait_tier, wait_until

L1 = ("--l1-size-gb", "0.02")
KEY_A, KEY_B = bytes(range(32)).hex(), bytes(range(1, 33)).hex()


def _share(server_factory, url: str, *extra: str, env: dict[str, str] | None = None, n: int = 4, seed: int = 1) -> dict:
    """Server A stores a prompt; server B, which never saw it, serves it from the shared tier."""
    tokens = prompt(n, seed=seed)
    a, b = (
        server_factory(*L1, "--l2", url, "--l2-negative-ttl", "0.3", *extra, env=env, start=False) for _ in range(2)
    )
    with ThreadPoolExecutor(2) as pool:  # start both at once (process start is mostly imports)
        list(pool.map(lambda p: p.start(), (a, b)))
    with a.client() as ca, b.client() as cb:
        ks, _ = register(ca)
        register(cb)
        assert lookup(cb, ks, tokens) == 0
        store(ca, ks, tokens, data(seed))
        wait_tier(ca, "puts", n)
        # B's first miss is remembered for the negative TTL: A's objects show up once it has passed
        wait_until(lambda: lookup(cb, ks, tokens, session=sid("s")) == n * 256, what="shared objects visible to B")
        assert retrieve(cb, "s", 0, n) == {(ch, 0): data(seed)(ch, 0) for ch in range(n)}
        t = tier(cb)
        assert t["hits"] == n and t["corrupt"] == 0 and t["puts"] == 0
        return t


def test_two_servers_share_one_redis(server_factory, redis_server) -> None:
    env = {"KVSERVER_L2_ENCRYPTION_KEY": KEY_A}
    t = _share(server_factory, redis_server.url, "--l2-compression", "lz4", env=env)
    assert t["tier"] == "redis"
    with redis_server.client() as r:
        assert r.dbsize() == 4
        blob = r.get(r.keys("kv1/*")[0])
        assert blob[:4] == b"KVL2" and blob[6] == 1  # AES-GCM, as configured


def test_two_servers_share_a_redis_cluster(server_factory, redis_cluster) -> None:
    t = _share(server_factory, redis_cluster.url, n=16, seed=2)
    assert t["tier"] == "redis-cluster"
    per_node = []
    for node in redis_cluster.nodes:
        with node.client() as r:
            per_node.append(int(r.dbsize()))
    assert sum(per_node) == 16 and sum(1 for n in per_node if n) >= 2  # spread over the shards


def test_two_servers_share_an_s3_bucket(server_factory, moto_s3, s3_bucket) -> None:
    t = _share(server_factory, moto_s3.url(s3_bucket, "team/kv"), env=S3_ENV, seed=3)
    assert t["tier"] == "s3"
    listed = moto_s3.client().list_objects_v2(Bucket=s3_bucket, Prefix="team/kv/")
    assert listed["KeyCount"] == 4


def test_damaged_redis_values_are_counted_misses_and_deleted(server_factory, redis_server) -> None:
    tokens = prompt(4, seed=4)
    a = server_factory(*L1, "--l2", redis_server.url)
    with a.client() as c:
        ks, _ = register(c)
        store(c, ks, tokens, data(4))
        wait_tier(c, "puts", 4)
        keys = object_keys(ks, tokens)
        with redis_server.client() as r:
            value = r.get(keys[2])
            r.setrange(keys[2], 500, bytes([value[500] ^ 0x01]))  # one bit flipped
            r.set(keys[3], value[:1000])  # truncated
        assert c.call("clear").result["removed"] == 4  # L1 forgets; the next lookup asks Redis
        assert lookup(c, ks, tokens, session=sid("s")) == 2 * 256
        assert retrieve(c, "s", 0, 2) == {(ch, 0): data(4)(ch, 0) for ch in range(2)}
        assert tier(c)["corrupt"] == 2
        with redis_server.client() as r:
            wait_until(lambda: r.exists(keys[2], keys[3]) == 0, what="corrupt values deleted")
            assert r.exists(keys[0], keys[1]) == 2


def test_wrong_encryption_key_is_a_miss_and_never_shown(server_factory, redis_server, tmp_path: Path) -> None:
    key_file = tmp_path / "a.key"
    key_file.write_text(KEY_A + "\n")
    tokens = prompt(4, seed=5)
    a = server_factory(*L1, "--l2", redis_server.url, "--l2-encryption-key-file", str(key_file), start=False)
    wrong = server_factory(*L1, "--l2", redis_server.url, env={"KVSERVER_L2_ENCRYPTION_KEY": KEY_B}, start=False)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda p: p.start(), (a, wrong)))
    with a.client() as c:
        ks, _ = register(c)
        store(c, ks, tokens, data(5))
        wait_tier(c, "puts", 4)
    with wrong.client() as c:
        register(c)
        assert lookup(c, ks, tokens) == 0
        t = tier(c)
        assert t["undecryptable"] == 4 and t["hits"] == 0
        described = repr(c.call("describe").result)
        assert KEY_B not in described and KEY_A not in described
    with redis_server.client() as r:
        assert r.dbsize() == 4  # intact objects are kept for the servers that hold the key
    with a.client() as c:
        c.call("clear")
        assert lookup(c, ks, tokens, session=sid("s")) == 4 * 256  # the right key opens them
        assert retrieve(c, "s", 3, 4) == {(3, 0): data(5)(3, 0)}
        assert tier(c)["hits"] == 4
    for proc in (a, wrong):
        proc.stop()
        assert KEY_A not in proc.log() and KEY_B not in proc.log()


def test_redis_going_away_and_coming_back(server_factory, redis_server) -> None:
    s = server_factory(*L1, "--l2", redis_server.url + "?timeout=0.5", "--l2-prefetch-timeout", "0.3")
    with s.client() as c:
        ks, _ = register(c)
        store(c, ks, prompt(2, seed=6), data(6))
        wait_tier(c, "puts", 2)
        redis_server.stop()
        during = prompt(3, seed=7)
        store(c, ks, during, data(7))  # stores still work, L1 serves them
        assert lookup(c, ks, during, session=sid("s")) == 3 * 256
        assert retrieve(c, "s", 0, 3) == {(ch, 0): data(7)(ch, 0) for ch in range(3)}
        assert lookup(c, ks, prompt(2, seed=8)) == 0  # a miss that asks the dead tier still answers
        t = wait_tier(c, "errors", 1)
        assert t["up"] is False
        wait_tier(c, "retry_pending", 3)  # the writes of `during` could not be done: kept for a retry
        redis_server.start()  # same port, empty
        wait_until(lambda: tier(c)["up"], 15, 0.05, what="tier back up")
        t = wait_tier(c, "retried", 3)  # written once the tier answered again
        assert t["retry_pending"] == 0 and t["dropped"] == 0
        wait_until(lambda: tier(c)["puts"] >= 5, what="retried writes put")
        with redis_server.client() as r:
            assert r.exists(*object_keys(ks, during)) == 3
        after = prompt(2, seed=9)
        store(c, ks, after, data(9))
        wait_tier(c, "puts", 7)
        with redis_server.client() as r:
            assert r.exists(*object_keys(ks, after)) == 2
        c.call("clear")
        assert lookup(c, ks, after) == 2 * 256  # and read back from it


def test_a_hung_redis_never_hangs_a_lookup(server_factory, redis_server) -> None:
    s = server_factory(*L1, "--l2", redis_server.url + "?timeout=1", "--l2-prefetch-timeout", "0.2")
    tokens = prompt(3, seed=10)
    with s.client(timeout=5.0) as c:
        ks, _ = register(c)
        store(c, ks, tokens[: 2 * 256], data(10))
        wait_tier(c, "puts", 2)
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            assert lookup(c, ks, tokens) == 2 * 256  # L1's part, answered after the bounded wait
            assert c.call("ping").result["version"]
            described = c.call("describe").result
            assert described["l2_queue"]["prefetch_timeouts"] >= 1
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        assert lookup(c, ks, tokens) == 2 * 256
