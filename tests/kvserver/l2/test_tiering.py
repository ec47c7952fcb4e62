"""L1 and L2 as one cache (`--l2-admission evicted` / `evicted-hit`) through real kvserver processes
over a real fs tier: objects are written when L1 evicts them, an object L2 already holds is dropped
from L1 without a write, the demotion rule decides what L2 lacks, and L2's own eviction (by
`--l2-capacity-gb`) never cuts a prefix."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import httpx
from kvprotocol import Client
from kvserver.l2.fs import FsAdapter
from kvtestkit.kvhelpers import lookup, register, store
from l2util import SIZE, data, object_keys, prompt, tier, wait_until

L1 = ("--l1-size-gb", "0.001")  # 64 objects of 16 KiB


def _tiering(c: Client) -> dict[str, Any]:
    return dict(c.call("describe").result["l2_queue"]["admission"])


def _settled(c: Client) -> dict[str, Any]:
    """Tiering counters once every queued write is done (written or skipped: evicted from L2 first)."""

    def done() -> dict[str, Any] | None:
        d = c.call("describe").result
        q, t = d["l2_queue"], d["l2_queue"]["admission"]
        done = d["l2"][0]["puts"] + q["skipped_evicted"] == t["demoted"] and not q["deletes_in_flight"]
        return t if done else None

    return dict(wait_until(done, what="the write-behind queue to drain"))


def _files(root: Path, keys: list[str]) -> dict[str, tuple[int, int]]:
    """(inode, mtime ns) of each key's file in the fs tier, for the keys that have one."""
    fs = FsAdapter(root)  # only for its file naming
    out = {}
    for key in keys:
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(fs.path_of(key))
            out[key] = (st.st_ino, st.st_mtime_ns)
    return out


def _all_files(root: Path) -> list[Path]:
    return [p for p in (root / "objects").rglob("*") if p.is_file()]


def _push_out(c: Client, ks: Any, seeds: range) -> None:
    """Store enough 4-chunk prompts to evict everything else from the 64-object L1."""
    for seed in seeds:
        store(c, ks, prompt(4, seed=seed), data(seed))


def test_an_object_l2_holds_leaves_l1_without_a_write(server_factory, tmp_path: Path) -> None:
    root = tmp_path / "l2"
    s = server_factory(*L1, "--l2", f"fs://{root}", "--l2-admission", "evicted", http=True)
    a = prompt(4, seed=1)
    with s.client() as c:
        ks, _ = register(c)
        store(c, ks, a, data(1))
        _push_out(c, ks, range(100, 120))  # a leaves L1: written to L2 then, not at its commit
        first = _settled(c)
        names = object_keys(ks, a)
        before = _files(root, names)
        assert len(before) == 4
        assert lookup(c, ks, a) == 4 * 256  # loaded back from L2 into L1
        _push_out(c, ks, range(200, 220))  # a leaves L1 again: L2 still holds it
        second = _settled(c)
        assert second["free_drops"] >= first["free_drops"] + 4
        assert _files(root, names) == before  # not written again (same file, same mtime)
        assert tier(c)["puts"] == second["demoted"]  # every write is a first write of its object
        metrics = httpx.get(f"{s.http_url}/metrics", timeout=5).text
        assert f"kvserver_l2_free_drops_total {float(second['free_drops'])}" in metrics
        c.call("clear")
        assert lookup(c, ks, a) == 4 * 256


def test_every_object_is_written_once_and_commits_write_nothing(server_factory, tmp_path: Path) -> None:
    root = tmp_path / "l2"
    s = server_factory(*L1, "--l2", f"fs://{root}", "--l2-admission", "evicted")
    with s.client() as c:
        ks, _ = register(c)
        _push_out(c, ks, range(10, 30))  # 80 objects through a 64-object L1
        t = _settled(c)
        stats = tier(c)
        evictions = c.call("describe").result["l1"]["evictions"]
        assert 0 < t["demoted"] == evictions == stats["puts"]  # what L1 evicted, nothing it still holds
        assert len(_all_files(root)) == evictions
        c.call("clear")
        assert lookup(c, ks, prompt(4, seed=10)) == 4 * 256  # the first prompt, evicted first, is in L2


def test_evicted_hit_admits_only_what_l1_saw_hit(server_factory, tmp_path: Path) -> None:
    root = tmp_path / "l2"
    s = server_factory(*L1, "--l2", f"fs://{root}", "--l2-admission", "evicted-hit")
    hot, cold = prompt(4, seed=2), prompt(4, seed=3)
    with s.client() as c:
        ks, _ = register(c)
        store(c, ks, hot, data(2))
        store(c, ks, cold, data(3))
        assert lookup(c, ks, hot) == 4 * 256  # L1 hit: hot is now worth a write when evicted
        _push_out(c, ks, range(300, 320))
        t = _settled(c)
        evictions = c.call("describe").result["l1"]["evictions"]
        assert t["demoted"] == 4 and t["declined"] == evictions - 4 > 4  # hot only; cold and fillers declined
        assert len(_files(root, object_keys(ks, hot))) == 4
        assert _files(root, object_keys(ks, cold)) == {}
        c.call("clear")
        assert lookup(c, ks, hot) == 4 * 256
        assert lookup(c, ks, cold) == 0


def test_l2_eviction_keeps_prefixes_whole(server_factory, tmp_path: Path) -> None:
    """L2 holds two objects. Chunks a, b are in L2; the prompt a, b, c is read, then L1 evicts c
    first (tail first). Writing c would need room: plain LRU would evict b (the oldest) and leave
    a, c, where c is useless; the directory refuses c instead and a, b keep serving."""
    root = tmp_path / "l2"
    cap = repr(2.5 * SIZE / (1 << 30))
    s = server_factory(
        *L1, "--l2", f"fs://{root}", "--l2-admission", "evicted-hit", "--l2-capacity-gb", cap,
    )  # fmt: skip
    abc = prompt(3, seed=4)
    ab = abc[: 2 * 256]
    with s.client() as c:
        ks, _ = register(c)
        store(c, ks, ab, data(4))
        assert lookup(c, ks, ab) == 2 * 256
        _push_out(c, ks, range(400, 420))  # fillers are never hit: declined, only a and b are written
        assert _settled(c)["demoted"] == 2
        assert lookup(c, ks, abc) == 2 * 256  # a, b from L2
        store(c, ks, abc, data(4), start_chunk=2)
        assert lookup(c, ks, abc) == 3 * 256  # all three hit in L1: c is worth a write
        _push_out(c, ks, range(500, 520))
        t = wait_until(lambda: (t := _tiering(c))["refused"] >= 1 and t, what="c refused")
        t = _settled(c)
        assert (t["objects"], t["evicted"], t["demoted"]) == (2, 0, 2)
        assert set(_files(root, object_keys(ks, abc))) == set(object_keys(ks, abc)[:2])
        c.call("clear")
        assert lookup(c, ks, abc) == 2 * 256


def test_l2_capacity_evicts_by_policy_and_deletes_files(server_factory, tmp_path: Path) -> None:
    root = tmp_path / "l2"
    cap = repr(10.5 * SIZE / (1 << 30))
    s = server_factory(*L1, "--l2", f"fs://{root}", "--l2-admission", "evicted", "--l2-capacity-gb", cap)
    with s.client() as c:
        ks, _ = register(c)
        _push_out(c, ks, range(600, 630))  # 120 objects: L1 evicts 50-odd, L2 keeps 10
        t = _settled(c)
        assert t["objects"] == 10 and t["evicted"] == t["demoted"] - 10
        assert len(_all_files(root)) == 10  # _settled waited for the deletes too
        assert tier(c)["evicted"] >= t["evicted"]  # one deleted while its write ran is deleted again after


def test_a_prefetch_keeps_what_it_reads_though_its_room_demotes_them_out_of_l2(server_factory, tmp_path: Path) -> None:
    """L2 holds exactly prompt a. Reading a back into a full L1 evicts b, whose demotion makes L2
    evict a, the objects being read: their files are deleted only once the reads are over, so the
    lookup gets all of a (as one cache of both tiers would), and then L2 holds b, not a."""
    root = tmp_path / "l2"
    cap = repr(16.5 * SIZE / (1 << 30))
    s = server_factory(
        *L1, "--eviction-policy", "lru", "--l2", f"fs://{root}", "--l2-admission", "evicted-hit",
        "--l2-eviction-policy", "lru", "--l2-capacity-gb", cap,
    )  # fmt: skip
    a, b = prompt(16, seed=7), prompt(16, seed=8)
    with s.client() as c:
        ks, _ = register(c)
        store(c, ks, a, data(7))
        assert lookup(c, ks, a) == 16 * 256  # hit: a is demoted when L1 evicts it
        _push_out(c, ks, range(700, 716))  # never hit: declined; a goes to L2
        store(c, ks, b, data(8))
        assert lookup(c, ks, b) == 16 * 256
        _push_out(c, ks, range(716, 728))  # 48 newer objects: b is L1's oldest
        assert _settled(c)["objects"] == 16
        assert len(_files(root, object_keys(ks, a))) == 16
        assert lookup(c, ks, a) == 16 * 256  # every chunk read, though L2 evicted them meanwhile
        t = _settled(c)
        gone = t["evicted"]  # one of a per b demoted by the read's room (L1 keeps a b or two)
        assert gone == t["demoted"] - 16 >= 8 and t["objects"] == 16
        assert len(_files(root, object_keys(ks, a))) == 16 - gone  # deleted once they had been read
        assert len(_files(root, object_keys(ks, b))) == gone
        c.call("clear")
        assert lookup(c, ks, a) == (16 - gone) * 256  # L2's part of a: evicted from its tail
