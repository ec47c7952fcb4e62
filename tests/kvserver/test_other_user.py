"""With the default configuration, a process of another OS user can do nothing to the cache.

The intruder is a real client process (tests/kvserver/intruder.py) run as `nobody` against a real
server of this user, while the owner's own engine keeps working concurrently; afterwards the owner's
objects are intact: not read, not poisoned, not pinned, not cleared.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvtestkit.kvhelpers import lookup, payload, register, retrieve, store, tiny_layout, sid
from kvprotocol import pack_tokens

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
TOKENS = list(range(3000, 3000 + 512))


def _need_root() -> None:
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a process as another OS user")


def _as_nobody(args: list[str]) -> dict[str, str]:
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": "/nonexistent",
        "KVSERVER_STATE_DIR": os.environ["KVSERVER_STATE_DIR"],
    }  # it even knows where the token lies
    cmd = [*NOBODY, sys.executable, str(Path(__file__).with_name("intruder.py")), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=60, env=env, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_another_os_user_can_neither_read_write_pin_nor_clear(server_factory) -> None:
    _need_root()
    srv = server_factory("--l1-size-gb", "0.05", http=True)
    size = tiny_layout().object_bytes
    with srv.client() as owner:
        ks, _ = register(owner)
        store(owner, ks, TOKENS, lambda ch, g: payload(ch, size), salt="victim")
        arena = owner.call("describe").result["l1"]["arena"]
    stop, owner_errors, owner_ops = threading.Event(), [], [0]

    def owner_engine() -> None:  # a concurrent legitimate client of the same user
        with srv.client() as c:
            while not stop.is_set():
                try:
                    assert lookup(c, ks, TOKENS, salt="victim") == 512
                    owner_ops[0] += 1
                except Exception as exc:  # noqa: BLE001 - reported below
                    owner_errors.append(repr(exc))

    worker = threading.Thread(target=owner_engine)
    worker.start()
    try:
        token_file = Path(os.environ["KVSERVER_STATE_DIR"]) / f"token-{srv.port}"
        got = _as_nobody(
            [srv.url, srv.http_url, arena, str(token_file), json.dumps(ks.to_wire()), pack_tokens(TOKENS).hex()]
        )
    finally:
        stop.set()
        worker.join()
    print("intruder saw:", got, "owner lookups meanwhile:", owner_ops[0])
    assert got["read_token_file"] == "PermissionError" and got["open_arena"] == "PermissionError"
    assert got["ping"] == "OK"  # liveness only, like /healthz
    for op in ("describe", "lookup", "retrieve", "query", "store", "pin", "unpin", "clear", "clear_guessed"):
        assert got[op] == "UNAUTHORIZED", (op, got)
    for path in ("/v1/query", "/v1/pin", "/v1/unpin", "/v1/clear"):
        assert got[f"http{path}"] == "401", (path, got)
    assert not owner_errors and owner_ops[0] > 0
    with srv.client() as owner:  # nothing changed
        described = owner.call("describe").result
        assert described["l1"]["objects"] == 2 and described["l1"]["pinned"] == 0
        assert lookup(owner, ks, TOKENS, salt="victim", session=sid("mine")) == 512
        assert retrieve(owner, "mine", 0, 2) == {(0, 0): payload(0, size), (1, 0): payload(1, size)}
        assert described["errors"]["UNAUTHORIZED"] >= 9


def test_another_os_user_cannot_read_l2_files(server_factory, tmp_path: Path) -> None:
    _need_root()
    root = tmp_path / "l2"
    tmp_path.chmod(0o755)  # even with every parent open, the tier's own modes keep it private
    srv = server_factory("--l1-size-gb", "0.05", "--l2", f"fs://{root}")
    with srv.client() as owner:
        ks, _ = register(owner)
        store(owner, ks, TOKENS, lambda ch, g: payload(ch, tiny_layout().object_bytes))
    srv.stop()  # a graceful stop flushes write-behind
    files = [p for p in root.rglob("*") if p.is_file()]
    assert files
    done = subprocess.run([*NOBODY, "cat", str(files[0])], capture_output=True, check=False, timeout=30)
    assert done.returncode != 0 and b"Permission denied" in done.stderr
    done = subprocess.run([*NOBODY, "ls", str(root / "objects")], capture_output=True, check=False, timeout=30)
    assert done.returncode != 0 and b"Permission denied" in done.stderr


SQUATTER = """
import sys, msgpack, zmq
sock = zmq.Context().socket(zmq.ROUTER)
sock.bind(sys.argv[1])
print("listening", flush=True)
parts = sock.recv_multipart()
print("got", "auth" in msgpack.unpackb(parts[1]), flush=True)
"""


def test_a_port_squatter_of_another_user_never_receives_the_token(server_factory) -> None:
    """The owner's server is down; another user binds its port. A same-user client must not send
    the token from the owner's default file to it."""
    _need_root()
    srv = server_factory("--l1-size-gb", "0.01")
    srv.stop()  # the token file stays, as after any stop
    from kvprotocol import Client, RequestTimeout, resolve_token

    assert resolve_token(None, srv.url)  # no listener: the file is used (the server may come back)
    squatter = subprocess.Popen(
        [*NOBODY, sys.executable, "-c", SQUATTER, srv.url],
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
        env={"PATH": os.environ.get("PATH", "")},
    )
    try:
        assert squatter.stdout is not None and squatter.stdout.readline().strip() == "listening"
        assert resolve_token(None, srv.url) is None
        with Client(srv.url, timeout=1) as c, pytest.raises(RequestTimeout):  # the squatter never answers
            c.call("describe")
        out, _ = squatter.communicate(timeout=10)
        assert out.strip() == "got False"  # it received the request, without any token
    finally:
        squatter.kill()
        squatter.wait()
