"""One server per arena, always: a second server never touches a live server's segment, a failed
start leaves nothing behind, and an arena that /dev/shm cannot hold is refused with the fix named."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtestkit.kvhelpers import ArenaMap, lookup, payload, register, retrieve, store, tiny_layout, sid
from kvtestkit.serverproc import BIN

OBJ = tiny_layout().object_bytes
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def start_fails(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [str(BIN / "kvserver"), "start", "--http-port", "0", "--l1-size-gb", "0.05", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0, done.stdout + done.stderr
    return done


def test_second_server_leaves_the_first_fully_working(server_factory):
    srv = server_factory("--l1-size-gb", "0.05")
    seg = Path(f"/dev/shm/kvserver-{srv.port}")
    inode = seg.stat().st_ino
    with srv.client() as c:
        ks, reg = register(c)
        arena = ArenaMap(reg["arena"]["name"], reg["arena"]["size"])
        first = list(range(512))
        store(c, ks, first, lambda ch, g: payload(ch, OBJ), mode="shm", arena=arena)

        same_port = start_fails("--port", str(srv.port))
        assert "owns the arena" in same_port.stderr and f"pid {srv.proc.pid}" in same_port.stderr
        other_addr = start_fails("--host", "127.0.0.2", "--port", str(srv.port))  # binds, but the arena is taken
        assert "owns the arena" in other_addr.stderr
        other_prefix = start_fails("--shm-prefix", "kvtest-other", "--port", str(srv.port))
        assert "cannot bind" in other_prefix.stderr
        assert not Path(f"/dev/shm/kvtest-other-{srv.port}").exists()  # a failed start removes what it made
        assert not Path(f"/dev/shm/kvtest-other-{srv.port}.lock").exists()

        assert seg.stat().st_ino == inode  # the live segment was never replaced
        # shm writers (old mapping), a fresh mapping and tcp readers all agree
        second = list(range(10_000, 10_512))
        store(c, ks, second, lambda ch, g: payload(50 + ch, OBJ), mode="shm", arena=arena)
        fresh = ArenaMap(reg["arena"]["name"], reg["arena"]["size"])
        for tokens, seed in ((first, 0), (second, 50)):
            assert lookup(c, ks, tokens, session=sid("check")) == 512
            tcp = retrieve(c, "check", 0, 2, mode="tcp")
            assert tcp == {(0, 0): payload(seed, OBJ), (1, 0): payload(seed + 1, OBJ)}
            assert retrieve(c, "check", 0, 2, mode="shm", arena=fresh) == tcp
            c.call("release", session=sid("check"))
        arena.close()
        fresh.close()
    assert srv.stop(keep_arena=True) == 0
    assert seg.exists() and not Path(f"{seg}.lock").exists()  # the segment is left to adopt, the lock goes


def test_arena_larger_than_free_shm_is_refused_with_the_fix(server_factory):
    st = os.statvfs("/dev/shm")
    free_gb = st.f_bavail * st.f_frsize / (1 << 30)
    too_big = min(4096, int(free_gb) + 2)
    srv = server_factory(start=False)
    done = start_fails("--port", str(srv.port), "--l1-size-gb", str(too_big))
    assert "--shm-size" in done.stderr and "emptyDir" in done.stderr and "--l1-size-gb" in done.stderr
    assert not Path(f"/dev/shm/kvserver-{srv.port}").exists()
    assert not Path(f"/dev/shm/kvserver-{srv.port}.lock").exists()


def test_a_crashed_servers_lock_does_not_block_a_restart(server_factory):
    srv = server_factory("--l1-size-gb", "0.01")
    lock = Path(f"/dev/shm/kvserver-{srv.port}.lock")
    assert lock.read_text() == str(srv.proc.pid)
    srv.kill()
    assert lock.exists()  # left behind, but nobody holds it
    again = server_factory("--l1-size-gb", "0.01", port=srv.port)
    assert lock.read_text() == str(again.proc.pid) and "adopted:" in again.log()
    with again.client() as c:
        ks, _ = register(c)
        store(c, ks, list(range(256)), lambda ch, g: payload(7, OBJ))
        assert lookup(c, ks, list(range(256))) == 256


_SQUAT = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.pwrite(fd, b"1", 0)  # a pid of its choosing: the refusal must not trust it
print("ready", flush=True)
sys.stdin.read()  # holds the lock until the test closes stdin
"""


def test_another_users_squatted_lock_or_segment_is_refused_naming_its_owner(server_factory):
    """A real `nobody` squats the .lock (holding a flock) or the segment of a port; the server refuses
    to start naming uid 65534 and the way out, touches neither file, and a running server keeps serving."""
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a process as another OS user")
    bystander = server_factory("--l1-size-gb", "0.01")
    port = server_factory(start=False).port
    for path in (Path(f"/dev/shm/kvserver-{port}.lock"), Path(f"/dev/shm/kvserver-{port}")):
        squatter = subprocess.Popen(
            [*NOBODY, sys.executable, "-c", _SQUAT, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd="/",
        )
        try:
            assert squatter.stdout is not None and squatter.stdout.readline().strip() == "ready"
            done = start_fails("--port", str(port), "--l1-size-gb", "0.01")
            assert "uid 65534" in done.stderr and "--shm-prefix" in done.stderr and str(path) in done.stderr
            assert path.stat().st_uid == 65534  # not removed, not taken over
            if not path.name.endswith(".lock"):  # the lock it did take is released on the way out
                assert not Path(f"/dev/shm/kvserver-{port}.lock").exists()
            with bystander.client() as c:
                ks, _ = register(c)
                store(c, ks, list(range(256)), lambda ch, g: payload(3, OBJ))
                assert lookup(c, ks, list(range(256))) == 256
        finally:
            assert squatter.stdin is not None
            squatter.stdin.close()
            squatter.wait(timeout=10)
            path.unlink(missing_ok=True)
    again = server_factory("--l1-size-gb", "0.01", port=port)  # once the squatter is gone: starts
    with again.client() as c:
        assert c.call("ping").result["protocol"]
