"""/v1/status and /metrics on loopback: another OS user sees aggregates, never who uses the server.

The reader is a real process run as `nobody` (setpriv) against a real server with tenants made by the
real CLI; the owner, holding the token, sees the tenant rows, per-tenant series and engine pids.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from kvtestkit.httpkv import parse_metrics
from kvtestkit.kvhelpers import lookup, payload, store, tiny_layout
from kvtestkit.tenants import add_tenant
from kvprotocol import Client, KeySpace

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
TENANT = "alice-secret-tenant"
ENGINE_PID = 4_242_424  # a pid no process has: easy to spot in a body
TOKENS = list(range(7000, 7000 + 512))

_READER = """
import json, sys, urllib.request, urllib.error
out = {}
for path in ("/v1/status", "/metrics"):
    for name, headers in (("plain", {}), ("wrong", {"Authorization": "Bearer not-the-token"})):
        req = urllib.request.Request(sys.argv[1] + path, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                out[f"{name}{path}"] = [resp.status, resp.read().decode()]
        except urllib.error.HTTPError as exc:
            out[f"{name}{path}"] = [exc.code, exc.read().decode()]
print(json.dumps(out))
"""


def _as_nobody(http_url: str) -> dict[str, list]:
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a process as another OS user")
    env = {"PATH": os.environ.get("PATH", ""), "HOME": "/nonexistent"}
    done = subprocess.run(
        [*NOBODY, sys.executable, "-c", _READER, http_url],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        env=env,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_another_user_sees_aggregates_and_the_owner_sees_tenants_and_pids(server_factory, tmp_path) -> None:
    tenants = tmp_path / "tenants.json"
    token = add_tenant(tenants, TENANT, "--l1-quota-gb", "0.01")
    srv = server_factory("--l1-size-gb", "0.05", "--tenants-file", str(tenants), http=True)
    layout = tiny_layout()
    with Client(srv.url, token=token) as alice:
        alice.call(
            "register_engine",
            model="m",
            world_size=1,
            rank=0,
            groups=[layout.to_wire()],
            host=socket.gethostname() + "-elsewhere",  # not checkable here: the registration stays
            pid=ENGINE_PID,
        )
        ks = KeySpace.from_layouts("m", 1, [layout])
        store(alice, ks, TOKENS, lambda ch, g: payload(ch, layout.object_bytes))

        seen = _as_nobody(srv.http_url)
        status, metrics = seen["plain/v1/status"], seen["plain/metrics"]
        assert status[0] == 200 and metrics[0] == 200
        for body in (status[1], metrics[1]):
            assert TENANT not in body and str(ENGINE_PID) not in body and "elsewhere" not in body
        public = json.loads(status[1])
        assert public["view"] == "aggregate" and "tenants" not in public
        assert public["engines"] == [{"model": "m", "world_size": 1, "rank": 0}]
        assert public["l1"]["used_bytes"] > 0  # the aggregates stay
        names = {name for name, _ in parse_metrics(metrics[1])}
        assert {"kvserver_l1_capacity_bytes", "kvserver_engines"} <= names
        assert not [name for name in names if name.startswith("kvserver_tenant_")]
        assert seen["wrong/v1/status"][0] == 403 and seen["wrong/metrics"][0] == 403  # refused, not downgraded

        with srv.http() as owner:  # the server's token
            full = owner.get("/v1/status").json()
            assert TENANT in full["tenants"] and full["engines"][0]["pid"] == ENGINE_PID
            scraped = owner.get("/metrics").text
            assert f'kvserver_tenant_l1_quota_bytes{{tenant="{TENANT}"}}' in scraped
        assert lookup(alice, ks, TOKENS) == 512  # the tenant kept working throughout
