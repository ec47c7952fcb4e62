"""A fs:// L2 root another OS user prepared is never trusted (#34 finding 6).

The attack: another user pre-creates the L2 root (in a world-writable place) with `tmp` a symlink
to a directory of the server's user. The server used to chmod that directory and delete its old
files. Now it checks ownership with lstat, never follows links inside the tier, refuses the tier
(it stays refused: nothing is retried into it) and keeps serving from L1.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kvtestkit.coordproc import wait_for

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def _need_root() -> None:
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a process as another OS user")


def _shared_parent() -> str:
    """A world-writable sticky directory every user can reach (/tmp may be private to root here)."""
    for cand in ("/tmp", "/var/tmp", "/dev/shm"):
        st = os.stat(cand)
        if st.st_mode & 0o1777 == 0o1777:
            return cand
    pytest.skip("no world-writable sticky directory to share with another user")


def _victim_dir(tmp_path: Path) -> tuple[Path, Path]:
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o750)
    os.chmod(victim, 0o750)
    old = victim / "precious.txt"
    old.write_text("keep me")
    past = time.time() - 7200
    os.utime(old, (past, past))  # older than the stale-temp cutoff
    return victim, old


def _l2_tiers(srv) -> list[dict]:  # type: ignore[no-untyped-def]
    with srv.client() as c:
        return list(c.call("describe").result["l2"])


@pytest.mark.parametrize("owner", ["stranger", "self-open"])
def test_an_untrusted_fs_root_is_refused_and_nothing_outside_it_is_touched(
    server_factory, tmp_path, request, owner: str
) -> None:
    _need_root()
    # outside pytest's 0700 tree, so the stranger can reach it
    shared = Path(tempfile.mkdtemp(prefix="kv-shared-", dir=_shared_parent()))
    os.chmod(shared, 0o1777)  # like /tmp
    request.addfinalizer(lambda: shutil.rmtree(shared, ignore_errors=True))
    victim, old = _victim_dir(tmp_path)
    root = shared / "l2"
    if owner == "stranger":
        script = (
            f"import os; os.mkdir({str(root)!r}, 0o777); os.chmod({str(root)!r}, 0o777); "
            f"os.symlink({str(victim)!r}, {str(root / 'tmp')!r})"
        )
        done = subprocess.run([*NOBODY, sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
    else:  # our own root, but left writable by others: a stranger may have planted a link in it
        root.mkdir()
        os.chmod(root, 0o777)
        (root / "objects").mkdir()
        os.symlink(victim, root / "tmp")
    srv = server_factory("--l1-size-gb", "0.01", "--l2", f"fs://{root}")
    wait_for(lambda: [t for t in _l2_tiers(srv) if not t["up"]], what="the tier refused")
    assert "refusing the fs tier" in srv.log() or "cannot be trusted" in srv.log(), srv.log()
    assert old.read_text() == "keep me"  # not swept
    assert victim.stat().st_mode & 0o777 == 0o750  # not chmodded
    with srv.client() as c:  # the server keeps serving from L1
        assert c.call("ping").result is not None
    assert sorted(p.name for p in victim.iterdir()) == ["precious.txt"]  # nothing written through the link


def test_a_symlink_inside_our_own_private_root_is_refused(server_factory, tmp_path) -> None:
    victim, old = _victim_dir(tmp_path)
    root = tmp_path / "l2"
    root.mkdir(mode=0o700)
    os.symlink(victim, root / "tmp")
    srv = server_factory("--l1-size-gb", "0.01", "--l2", f"fs://{root}")
    wait_for(lambda: [t for t in _l2_tiers(srv) if not t["up"]], what="the tier refused")
    assert "is not a directory (a symlink" in srv.log(), srv.log()
    assert old.read_text() == "keep me" and victim.stat().st_mode & 0o777 == 0o750


def test_a_fresh_root_is_created_private_and_works(server_factory, tmp_path) -> None:
    root = tmp_path / "deep" / "l2"
    srv = server_factory("--l1-size-gb", "0.01", "--l2", f"fs://{root}")
    wait_for(lambda: (root / "tmp").is_dir(), what="the tier prepared")
    for path in (root, root / "objects", root / "tmp"):
        assert path.stat().st_mode & 0o777 == 0o700
    assert all(t["up"] for t in _l2_tiers(srv))
