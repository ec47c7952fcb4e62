"""Connections that never send a request are closed (#34 finding 11), against a real kvserver.

Another OS user (`nobody`, via setpriv) opens many connections to the ZMQ and HTTP ports that never
finish a handshake or a request head; the server must close them after --idle-timeout (its
descriptor count, read from /proc/PID/fd, falls back) while a bystander that connected before the
attack, and then idled through it, keeps working. No timing decides a result: the test waits for
conditions with deadlines.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtestkit.coordproc import wait_for

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
INTRUDER = Path(__file__).with_name("idle_intruder.py")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_idle_connections_of_another_user_are_closed_and_a_bystander_keeps_working(server_factory: Any) -> None:
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a process as another OS user")
    srv = server_factory("--l1-size-gb", "0.02", "--idle-timeout", "1", http=True)
    pid = srv.proc.pid
    bystander, http = srv.client(), srv.http()
    assert bystander.call("describe").result["version"] and http.get("/v1/status").status_code == 200
    before = fds(pid)
    count = 150  # per port
    env = {"PATH": os.environ.get("PATH", ""), "HOME": "/nonexistent"}
    cmd = [*NOBODY, sys.executable, str(INTRUDER), str(srv.port), str(srv.http_port), str(count), "30"]
    intruder = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd="/")
    try:
        assert intruder.stdout is not None
        assert json.loads(intruder.stdout.readline())["opened"] == 2 * count
        # the intruder still holds all its sockets; the server lets go of its ends
        wait_for(lambda: fds(pid) <= before + 4, timeout=20, what="the server to close the idle connections")
        out, _ = intruder.communicate(timeout=40)
    finally:
        intruder.kill()
    assert json.loads(out.strip().splitlines()[-1])["closed"] == 2 * count
    # the bystander idled through the whole attack (longer than the idle timeout) on its connection
    assert bystander.call("describe").result["version"] and bystander.call("ping").result["version"]
    assert http.get("/v1/status").status_code == 200
    bystander.close()
    http.close()


def test_http_connections_are_capped_by_closing_the_longest_idle(server_factory: Any) -> None:
    srv = server_factory("--l1-size-gb", "0.02", "--idle-timeout", "60", "--http-max-connections", "16", http=True)
    pid = srv.proc.pid
    before = fds(pid)
    idle = [socket.create_connection(("127.0.0.1", srv.http_port), timeout=5) for _ in range(64)]
    try:
        with srv.http() as http:  # a new client past the cap gets in: an idle one makes room
            assert http.get("/v1/status").status_code == 200
        wait_for(lambda: fds(pid) <= before + 17, timeout=10, what="at most 16 HTTP connections")
        first = idle[0]
        first.settimeout(5)
        assert first.recv(1) == b""  # the longest-idle connection was closed
    finally:
        for s in idle:
            s.close()
