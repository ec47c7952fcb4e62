"""No credential leaves for a stranger's socket, and a token-less coordinator is not open.

The attack: the server's HTTP API listens on 127.0.0.1:H; another OS user listens on [::1]:H and
gets an instance at http://[::1]:H into the coordinator. The owner check must match the exact
address and family (not just the port), and the coordinator must never derive a credential from a
URL a registrant chose: it presents only the instance token it was given, and only to sockets of
its own user. The coordinator itself is authenticated by default, like the server.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from kvtestkit.coordproc import wait_for
from kvprotocol._credentials import default_token, listener_is_ours, listener_uids, token_path
from kvcoordinator.index import PrefixIndex

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def _need_root_and_v6() -> None:
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a process as another OS user")
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")


class Squatter:
    """A `nobody` HTTP listener on host:port that reports every Authorization header it receives."""

    def __init__(self, host: str, port: int) -> None:
        env = {"PATH": os.environ.get("PATH", ""), "HOME": "/nonexistent"}
        self.proc = subprocess.Popen(
            [*NOBODY, sys.executable, str(Path(__file__).with_name("squatter_http.py")), host, str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd="/",
        )
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline().strip()
        assert first == "ready", self.proc.stderr.read() if self.proc.stderr else first
        self.seen: list[dict[str, str | None]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.seen.append(json.loads(line))

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def test_owner_check_matches_exact_address_and_family(server_factory) -> None:
    _need_root_and_v6()
    srv = server_factory("--l1-size-gb", "0.01", http=True)
    port = srv.http_port
    assert listener_uids("127.0.0.1", port) == {os.getuid()}
    assert listener_uids("::1", port) == set()  # nothing on [::1]:H yet
    squatter = Squatter("::1", port)
    try:
        assert listener_uids("::1", port) == {65534}
        assert listener_uids("127.0.0.1", port) == {os.getuid()}  # the same port, another address
        assert not listener_is_ours("::1", port)
        assert default_token(f"http://[::1]:{port}") is None  # the stranger's socket gets no token
        assert default_token(f"http://127.0.0.1:{port}") == token_path(port).read_text().strip()
    finally:
        squatter.stop()


def test_coordinator_sends_no_token_to_a_strangers_socket(server_factory, coordinator_factory) -> None:
    """The attack end to end: the victim's own token (its default file) never reaches the squatter,
    even when the coordinator holds an explicit instance token and the squatter's entry is registered."""
    _need_root_and_v6()
    srv = server_factory("--l1-size-gb", "0.01", http=True)
    victim_token = token_path(srv.http_port).read_text().strip()
    coord = coordinator_factory("--instance-token-file", str(token_path(srv.http_port)), env={})
    squatter = Squatter("::1", srv.http_port)
    try:
        # the stranger cannot register: the coordinator generated a token, and it is not the stranger's
        reg = {
            "zmq_url": "tcp://127.0.0.1:1",
            "http_url": f"http://[::1]:{srv.http_port}",
            "l1_capacity_bytes": 1,
            "version": "0",
            "heartbeat_interval": 30.0,
        }
        assert httpx.post(f"{coord.url}/v1/instances", json=reg, timeout=5).status_code == 401
        # even registered (say by a careless operator), the squatter is asked without credentials
        assert coord.post("/v1/instances", json=reg).status_code == 201
        genuine = {**reg, "zmq_url": srv.url, "http_url": f"http://127.0.0.1:{srv.http_port}"}
        assert coord.post("/v1/instances", json=genuine).status_code == 201
        rows = {r["http_url"]: r for r in coord.get("/v1/fleet/status").json()["instances"]}
        wait_for(lambda: squatter.seen, what="the coordinator to ask the squatter")
        assert all(seen["authorization"] is None for seen in squatter.seen), squatter.seen
        assert rows[f"http://[::1]:{srv.http_port}"]["reachable"] is False
        assert rows[genuine["http_url"]]["reachable"] is True  # the owner's instance still gets its token
        # and with the token the squatter did not get, /v1/clear is the owner's alone
        assert victim_token not in json.dumps(squatter.seen)
    finally:
        squatter.stop()


def test_token_less_coordinator_is_authenticated_by_default(coordinator_factory, tmp_path) -> None:
    """A stranger (another OS user) can neither register, forge feeds, nor use the coordinator as a
    confused deputy for /v1/fleet/lookup or /v1/fleet/status."""
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a process as another OS user")
    coord = coordinator_factory(env={})
    path = token_path(coord.port)
    assert path.stat().st_mode & 0o777 == 0o600 and coord.token == path.read_text().strip()
    script = f"""
import httpx, json
url = {coord.url!r}
reg = {{"zmq_url": "tcp://127.0.0.1:1", "http_url": "http://127.0.0.1:2", "l1_capacity_bytes": 1,
       "version": "0", "heartbeat_interval": 30.0}}
look = {{"model": "m", "world_size": 1, "groups": ["0123456789abcdef"], "tokens": [1, 2, 3], "mode": "fanout"}}
out = {{"register": httpx.post(url + "/v1/instances", json=reg).status_code,
       "lookup": httpx.post(url + "/v1/fleet/lookup", json=look).status_code,
       "status": httpx.get(url + "/v1/fleet/status").status_code,
       "instances": httpx.get(url + "/v1/instances").status_code,
       "healthz": httpx.get(url + "/healthz").status_code}}
try:
    open({str(path)!r}).read(); out["token_file"] = "READ"
except OSError as exc:
    out["token_file"] = type(exc).__name__
print(json.dumps(out))
"""
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": "/nonexistent",
        "KVSERVER_STATE_DIR": os.environ["KVSERVER_STATE_DIR"],
    }
    done = subprocess.run(
        [*NOBODY, sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env, cwd="/"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {
        "register": 401,
        "lookup": 401,
        "status": 401,
        "instances": 401,
        "healthz": 200,
        "token_file": "PermissionError",
    }
    assert coord.instances() == []  # the owner (its token file) still works, and nothing was registered


def test_prefix_index_bounds_what_one_instance_claims() -> None:
    index = PrefixIndex(max_per_slot=1000)
    index.add(0, range(5000))
    index.add(1, range(10))
    assert len(index) == 1000 and index.overflow == 4000
    index.remove(0, range(10))
    assert len(index) == 1000  # slot 1 still holds keys 0..9
