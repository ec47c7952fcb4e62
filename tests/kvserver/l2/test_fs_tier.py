"""The fs tier through real kvserver processes: round trip, warm restart, eviction keeps L2 copies,
damaged files become counted misses (and are deleted), a crash leaves nothing partial readable,
write-behind overflow is dropped and counted, bad settings are refused."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

from kvtestkit.kvhelpers import lookup, register, retrieve, store, sid
from kvserver.l2 import Serde
from kvserver.l2.fs import FsAdapter
from l2util import SIZE, data, object_keys, prompt, tier, wait_tier, wait_until, store_in_l2
from kvtestkit.serverproc import free_port

L1 = ("--l1-size-gb", "0.02")


def _files(root: Path) -> list[Path]:
    return [p for p in (root / "objects").rglob("*") if p.is_file()]


def test_round_trip_and_warm_restart(server_factory, tmp_path: Path) -> None:
    root = tmp_path / "l2"
    args = (*L1, "--l2", f"fs://{root}")
    a = server_factory(*args)
    first, second = prompt(4, seed=1), prompt(3, seed=2)
    with a.client() as c:
        ks, _ = register(c)
        store(c, ks, first, data(1))
        t = wait_tier(c, "puts", 4)
        assert t["dropped"] == 0 and t["tier"] == "fs" and t["url"] == f"fs://{root}"
        store(c, ks, second, data(2))  # stop right away: a graceful stop flushes the queue
    a.stop()
    assert len(_files(root)) == 7
    b = server_factory(*args)  # a new process: L1 is empty, the directory is not
    with b.client() as c:
        ks, _ = register(c)
        assert lookup(c, ks, first, session=sid("s1")) == 4 * 256
        got = retrieve(c, "s1", 0, 4)
        assert got == {(ch, 0): data(1)(ch, 0) for ch in range(4)}
        assert lookup(c, ks, second, session=sid("s2")) == 3 * 256
        assert retrieve(c, "s2", 2, 3) == {(2, 0): data(2)(2, 0)}
        t = tier(c)
        assert (t["gets"], t["hits"], t["corrupt"]) == (7, 7, 0)
        assert t["puts"] == 0  # prefetched objects are not written back to where they came from
        wait_tier(c, "objects", 7)


def test_eviction_from_l1_keeps_the_l2_copy(server_factory, tmp_path: Path) -> None:
    s = server_factory("--l1-size-gb", "0.001", "--l2", f"fs://{tmp_path}/l2")  # 1 MiB: 64 objects
    with s.client() as c:
        ks, _ = register(c)
        target = prompt(4, seed=10)
        store(c, ks, target, data(10))
        wait_tier(c, "puts", 4)
        for seed in range(11, 30):  # 19 x 4 objects through a 64-object L1
            store(c, ks, prompt(4, seed=seed), data(seed))
        described = c.call("describe").result
        assert described["l1"]["evictions"] > 0
        assert c.call("query", keyspace=ks.to_wire(), tokens=_packed(target)).result["prefix_tokens"] == 0
        assert lookup(c, ks, target, session=sid("back")) == 4 * 256  # loaded again from the fs tier
        assert retrieve(c, "back", 0, 4) == {(ch, 0): data(10)(ch, 0) for ch in range(4)}


def _packed(tokens: list[int]) -> bytes:
    from kvprotocol import pack_tokens

    return pack_tokens(tokens)


def test_damaged_files_are_counted_misses_and_deleted(server_factory, tmp_path: Path) -> None:
    root = tmp_path / "l2"
    s = server_factory(*L1, "--l2", f"fs://{root}", "--l2-compression", "zstd", "--l2-verify", "server")
    with s.client() as c:
        ks, tokens = store_in_l2(c, 5, seed=3)
        fs = FsAdapter(root)
        paths = [fs.path_of(k) for k in object_keys(ks, tokens)]
        flipped = bytearray(paths[1].read_bytes())
        flipped[len(flipped) // 2] ^= 0x10
        paths[1].write_bytes(bytes(flipped))  # a bit flip in the body
        paths[2].write_bytes(paths[2].read_bytes()[:-100])  # truncated
        paths[3].write_bytes(paths[0].read_bytes())  # chunk 0's object under chunk 3's name
        assert c.call("clear").result["removed"] == 5  # L1 forgets; the next lookup reads the files
        assert lookup(c, ks, tokens, session=sid("s")) == 256  # only chunk 0 is sound
        assert retrieve(c, "s", 0, 1) == {(0, 0): data(3)(0, 0)}
        t = tier(c)
        assert t["corrupt"] == 3 and t["hits"] == 2  # chunks 0 and 4 loaded; 4 is useless after the hole
        wait_until(lambda: not any(p.exists() for p in paths[1:4]), what="corrupt files deleted")
        assert paths[0].exists() and paths[4].exists()
        c.call("end_session", session=sid("s"))
        c.call("clear")
        assert lookup(c, ks, tokens) == 256  # and never served later either
        assert tier(c)["corrupt"] == 3


def test_crash_mid_write_leaves_no_readable_partial_object(server_factory, tmp_path: Path) -> None:
    root = tmp_path / "l2"
    args = ("--l1-size-gb", "0.05", "--l2", f"fs://{root}", "--l2-compression", "lz4")
    a = server_factory(*args)
    tokens = prompt(64, seed=4)
    with a.client() as c:
        ks, _ = register(c)
        store(c, ks, tokens, data(4))
        wait_tier(c, "puts", 1)  # write-behind is running
    a.stop(signal.SIGKILL)
    (root / "tmp" / "deadbeef-crashed.tmp").write_bytes(b"KVL2\x01partial")  # what a torn write leaves
    serde, key_of = Serde(), {FsAdapter(root).path_of(k): k for k in object_keys(ks, tokens)}
    for path in _files(root):  # every visible object is complete
        assert len(serde.decode(key_of[path], path.read_bytes())) == SIZE
    b = server_factory(*args)
    with b.client() as c:
        ks, _ = register(c)
        hit = lookup(c, ks, tokens, session=sid("s")) // 256
        got = retrieve(c, "s", 0, hit)
        assert got == {(ch, 0): data(4)(ch, 0) for ch in range(hit)}
        assert tier(c)["corrupt"] == 0


def test_write_behind_overflow_is_dropped_and_counted(server_factory, tmp_path: Path) -> None:
    s = server_factory(*L1, "--l2", f"fs://{tmp_path}/l2", "--l2-queue-size", "2")
    tokens = prompt(10, seed=5)
    with s.client() as c:
        ks, _ = register(c)
        store(c, ks, tokens, data(5))  # one commit enqueues 10 keys into a queue of 2
        assert lookup(c, ks, tokens) == 10 * 256  # the store itself is whole
        described = c.call("describe").result
        assert described["l2_queue"]["dropped"] == 8
        assert described["l2"][0]["dropped"] == 8
        wait_tier(c, "puts", 2)
        wait_tier(c, "objects", 2)


def _start(*args: str) -> subprocess.CompletedProcess[str]:
    exe = str(Path(sys.executable).parent / "kvserver")
    return subprocess.run(
        [exe, "start", "--port", str(free_port()), "--http-port", "0", "--l1-size-gb", "0.01", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_bad_l2_settings_are_refused_with_a_clear_error(tmp_path: Path) -> None:
    out = _start("--l2", "gopher://x")
    assert out.returncode != 0 and "scheme must be one of" in out.stderr
    out = _start("--l2", f"fs://{tmp_path}", "--l2-compression", "brotli")
    assert out.returncode == 2 and "brotli" in out.stderr
    bad_key = tmp_path / "bad.key"
    bad_key.write_text("not-a-key-0123")
    out = _start("--l2", f"fs://{tmp_path}", "--l2-encryption-key-file", str(bad_key))
    assert out.returncode != 0 and "not 16/24/32 bytes" in out.stderr and "not-a-key-0123" not in out.stderr


async def test_concurrent_lookups_share_one_load(server_factory, tmp_path: Path) -> None:
    from kvtestkit.kvhelpers import tiny_layout
    from kvprotocol import AsyncClient, pack_tokens

    s = server_factory(*L1, "--l2", f"fs://{tmp_path}/l2")
    layouts = [tiny_layout(), tiny_layout(block_bytes=512, tag="mla")]  # two object groups per chunk
    tokens = prompt(6, seed=6)
    with s.client() as c:
        ks, _ = register(c, layouts=layouts)
        store(c, ks, tokens, lambda ch, g: data(6)(ch, g)[: layouts[g].object_bytes])
        wait_tier(c, "puts", 12)
        c.call("clear")
    async with AsyncClient(s.url) as client:  # four lookups in flight at once, all missing L1
        fields = {"keyspace": ks.to_wire(), "tokens": pack_tokens(tokens)}
        replies = await asyncio.gather(*(client.call("lookup", **fields, session=sid(f"s{i}")) for i in range(4)))
        assert [r.result["hit_tokens"] for r in replies] == [6 * 256] * 4
    with s.client() as c:
        t = tier(c)
        assert t["gets"] == 12 and t["hits"] == 12  # each object read once, whoever asked first
        got = retrieve(c, "s3", 0, 6)
        assert got == {(ch, g): data(6)(ch, g)[: layouts[g].object_bytes] for ch in range(6) for g in range(2)}


def test_files_are_private_whatever_the_umask(server_factory, tmp_path: Path) -> None:
    import os
    import stat

    root = tmp_path / "l2-private"
    old = os.umask(0)  # the server inherits the most permissive umask there is
    try:
        srv = server_factory(*L1, "--l2", f"fs://{root}")
    finally:
        os.umask(old)
    with srv.client() as c:
        ks, _ = register(c)
        store(c, ks, prompt(2, seed=5), data(5))
        wait_tier(c, "puts", 2)
    files = _files(root)
    dirs = [root, *[p for p in root.rglob("*") if p.is_dir()]]
    assert len(files) == 2 and len(dirs) >= 4  # root, objects, tmp, one fan-out dir at least
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {oct(0o600)}
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in dirs} == {oct(0o700)}
