"""Warm restart against real processes: a server killed with `kill -9` (or stopped) and started again on
the same port re-adopts its committed objects, serves them byte-identical once their checksum passed,
and never adopts an arena that is not its own user's 0600 file of its size and format."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from kvtestkit.kvhelpers import ArenaMap, lookup, payload, register, retrieve, sid, store, tiny_layout
from kvprotocol import Client, flows
from kvprotocol import requests as rq
from kvtestkit.serverproc import BIN
from test_ec import ec_get, ec_put

OBJ = tiny_layout().object_bytes
SIZE = ("--l1-size-gb", "0.05")


def tokens(base: int, chunks: int) -> list[int]:
    return list(range(base, base + 256 * chunks))


def adopted(srv, timeout: float = 30.0) -> dict:
    """The restarted server's adoption summary, once every adopted object was verified."""
    deadline = time.monotonic() + timeout
    with srv.client() as c:
        while True:
            warm = c.call("describe").result["warm_restart"]
            done = warm["pending"] == 0 and warm["ec"]["pending"] == 0
            if done or time.monotonic() > deadline:
                assert done, warm
                return warm
            time.sleep(0.02)


def offsets(c: Client, ks, toks: list[int]) -> list[int]:
    """Arena offsets of a stored prefix's objects (chunk order), read through a shm retrieve."""
    lookup(c, ks, toks, session=sid("where"))
    req = rq.Retrieve(session=sid("where"), rank=0, start_chunk=0, end_chunk=len(toks) // 256, mode="shm")
    reply, _ = flows.retrieve_leased(c.send, req)
    c.call("release", session=sid("where"))
    return [o.offset for o in sorted(reply.objects, key=lambda o: o.chunk)]


def test_kill9_then_restart_serves_every_committed_object(server_factory):
    srv = server_factory(*SIZE)
    a, b, half = tokens(0, 8), tokens(100_000, 8), tokens(200_000, 2)
    with srv.client() as c:
        ks, reg = register(c)
        arena = ArenaMap(reg["arena"]["name"], reg["arena"]["size"])
        store(c, ks, a, lambda ch, g: payload(ch, OBJ))  # tcp
        store(c, ks, b, lambda ch, g: payload(100 + ch, OBJ), mode="shm", arena=arena)
        store(c, ks, half, lambda ch, g: payload(200 + ch, OBJ), commit=False)  # reserved, never committed
        arena.close()
    srv.kill()
    again = server_factory(*SIZE, port=srv.port)
    assert "adopted: 16 objects to verify" in again.log()
    warm = adopted(again)
    assert warm["adopted"] == warm["verified"] == 16 and warm["rejected"] == 0
    with again.client() as c:
        ks, reg = register(c)  # a new nonce: engines register again
        fresh = ArenaMap(reg["arena"]["name"], reg["arena"]["size"])
        for toks, seed in ((a, 0), (b, 100)):
            assert lookup(c, ks, toks, session=sid("after")) == len(toks)
            want = {(ch, 0): payload(seed + ch, OBJ) for ch in range(8)}
            assert retrieve(c, "after", 0, 8, mode="tcp") == want
            assert retrieve(c, "after", 0, 8, mode="shm", arena=fresh) == want
            c.call("release", session=sid("after"))
        assert lookup(c, ks, half) == 0  # a write in flight at the kill is forgotten
        store(c, ks, half, lambda ch, g: payload(200 + ch, OBJ))  # ... and its slot is usable again
        assert lookup(c, ks, half) == 512
        assert c.call("describe").result["l1"]["objects"] == 18
        fresh.close()


def test_graceful_stop_then_start_adopts(server_factory):
    srv = server_factory(*SIZE)
    a = tokens(0, 4)
    with srv.client() as c:
        ks, _ = register(c)
        store(c, ks, a, lambda ch, g: payload(ch, OBJ))
    assert srv.stop(keep_arena=True) == 0
    again = server_factory(*SIZE, port=srv.port)
    assert adopted(again)["verified"] == 4
    with again.client() as c:
        ks, _ = register(c)
        assert lookup(c, ks, a, session=sid("s")) == len(a)
        assert retrieve(c, "s", 0, 4) == {(ch, 0): payload(ch, OBJ) for ch in range(4)}


def test_bytes_corrupted_while_down_are_never_served(server_factory):
    srv = server_factory(*SIZE)
    a = tokens(0, 4)
    with srv.client() as c:
        ks, _ = register(c)
        store(c, ks, a, lambda ch, g: payload(ch, OBJ))
        where = offsets(c, ks, a)
    srv.kill()
    with open(srv.arena_path, "r+b") as f:  # one flipped byte in chunk 2's object
        f.seek(where[2] + 100)
        byte = f.read(1)
        f.seek(where[2] + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    again = server_factory(*SIZE, port=srv.port)
    warm = adopted(again)
    assert warm["verified"] == 3 and warm["rejected"] == 1
    with again.client() as c:
        ks, _ = register(c)
        assert lookup(c, ks, a, session=sid("s")) == 2 * 256  # the prefix ends at the corrupt chunk
        assert retrieve(c, "s", 0, 2) == {(ch, 0): payload(ch, OBJ) for ch in range(2)}


def _wrong_mode(path: Path) -> None:
    os.chmod(path, 0o644)


def _symlink(path: Path) -> None:
    target = path.with_name(path.name + "-elsewhere")
    os.rename(path, target)
    os.symlink(target, path)


def _format(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(24)  # the arena format, after magic and nonce
        f.write((99).to_bytes(4, "little"))


@pytest.mark.parametrize(
    ("spoil", "args", "why"),
    [
        (_wrong_mode, SIZE, "its mode is 644"),
        (_symlink, SIZE, "removed a symbolic link"),
        (_format, SIZE, "its format is 99"),
        (None, ("--l1-size-gb", "0.06"), "its size is"),
        (None, (*SIZE, "--cold"), "a cold start was asked for"),
    ],
)
def test_an_unfit_arena_is_never_adopted(server_factory, spoil, args, why):
    srv = server_factory(*SIZE)
    a = tokens(0, 2)
    with srv.client() as c:
        ks, _ = register(c)
        store(c, ks, a, lambda ch, g: payload(ch, OBJ))
    srv.kill()
    if spoil is not None:
        spoil(srv.arena_path)
    again = server_factory(*args, port=srv.port)
    assert why in again.log()
    with again.client() as c:
        ks, _ = register(c)
        assert lookup(c, ks, a) == 0
        assert c.call("describe").result["l1"]["objects"] == 0
    assert not srv.arena_path.is_symlink() and os.stat(srv.arena_path).st_mode & 0o777 == 0o600
    Path(f"{srv.arena_path}-elsewhere").unlink(missing_ok=True)


def test_another_users_arena_is_never_adopted(server_factory):
    srv = server_factory(*SIZE)
    with srv.client() as c:
        ks, _ = register(c)
        store(c, ks, tokens(0, 2), lambda ch, g: payload(ch, OBJ))
    srv.kill()
    os.chown(srv.arena_path, 65534, 65534)  # planted by (or handed to) another user
    again = server_factory(*SIZE, port=srv.port, start=False)
    with pytest.raises(RuntimeError, match="belongs to uid 65534"):
        again.start()
    assert os.stat(srv.arena_path).st_uid == 65534  # neither adopted nor removed
    srv.arena_path.unlink()


def test_tenant_usage_is_rebuilt_and_removed_tenants_dropped(server_factory, tmp_path):
    tenants = tmp_path / "tenants.json"

    def tenant(*argv: str) -> str:
        cmd = [str(BIN / "kvserver"), "tenant", *argv, "--tenants-file", str(tenants)]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()

    tok = {name: tenant("add", name) for name in ("alice", "bob")}
    args = (*SIZE, "--tenants-file", str(tenants))
    srv = server_factory(*args)
    a = tokens(0, 3)
    for name in ("alice", "bob"):
        with Client(srv.url, token=tok[name]) as c:
            ks, _ = register(c)
            store(c, ks, a, lambda ch, g: payload(ch, OBJ))
            ec_put(c, "img", payload(7, 4096))  # and one encoder output each
    with srv.client() as admin:
        before = admin.call("describe").result["tenants"]
    assert before["alice"]["l1_used_bytes"] == before["bob"]["l1_used_bytes"] == 3 * OBJ
    srv.kill()
    tenant("remove", "bob")
    again = server_factory(*args, port=srv.port)
    warm = adopted(again)
    assert warm["adopted"] == 3 and warm["dropped"] == 3
    assert warm["ec"]["adopted"] == 1 and warm["ec"]["dropped"] == 1
    with again.client() as admin:
        after = admin.call("describe").result["tenants"]
    assert after["alice"]["l1_used_bytes"] == 3 * OBJ and after.get("bob", {}).get("l1_used_bytes", 0) == 0
    with Client(again.url, token=tok["alice"]) as c:
        ks, _ = register(c)
        assert lookup(c, ks, a) == len(a)
        assert ec_get(c, "img") == payload(7, 4096)


def test_tails_are_found_again_after_a_restart(server_factory):
    """A tail is journaled with its length and key space: after `kill -9` a lookup with `tails` reaches
    into it again (a conversation's next turn loads to the token, not to the chunk), bytes intact."""
    srv = server_factory(*SIZE)
    long_, short = tokens(0, 4) + list(range(50_000, 50_100)), list(range(60_000, 60_070))  # tails of 100 and 70
    with srv.client() as c:
        ks, _ = register(c)
        store(c, ks, long_, lambda ch, g: payload(ch, OBJ), tail=True)
        store(c, ks, short, lambda ch, g: payload(300 + ch, OBJ), tail=True)  # a tail at chunk 0
        store(c, ks, long_, lambda ch, g: payload(ch, OBJ), salt="s", tail=True)
    srv.kill()
    again = server_factory(*SIZE, port=srv.port)
    assert adopted(again)["verified"] == 11  # 4 chunks and a tail, twice, and a lone tail
    with again.client() as c:
        ks, _ = register(c)
        assert lookup(c, ks, long_ + [1, 2, 3], tails=True, session=sid("t")) == 4 * 256 + 100
        assert retrieve(c, "t", 0, 5) == {(ch, 0): payload(ch, OBJ) for ch in range(5)}
        c.call("release", session=sid("t"))
        assert lookup(c, ks, short + [1, 2, 3], tails=True) == 70
        assert lookup(c, ks, long_ + [1, 2, 3], salt="s", tails=True) == 4 * 256 + 100
        assert lookup(c, ks, long_ + [1, 2, 3], salt="t", tails=True) == 0  # under its own salt only
        changed = long_[:-1] + [long_[-1] + 1]  # the tail's last token differs: not that tail
        assert lookup(c, ks, changed + [1], tails=True) == 4 * 256
