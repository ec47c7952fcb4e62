"""`kvcli top` one-shot (--once/--json) against real servers and a real coordinator, and the live
dashboard fed by the coordinator's fleet status."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvcli.top.app import TopApp, screen_text
from kvcli.top.sources import CoordinatorSource
from kvcli_testutil import CLI, assert_one_line_error
from kvtestkit.serverproc import free_port
from test_top_pilot import SIZE, cells, traffic, until

KVCLI = str(Path(sys.executable).parent / "kvcli")


def auth_for(coordinator: str) -> dict[str, str]:
    """The test's fleet token (the coordinator and every server share it through the environment)."""
    return {"Authorization": f"Bearer {os.environ['KVSERVER_API_TOKEN']}"}


@pytest.fixture
def coordinator(tmp_path: Path, fleet_token: str) -> Iterator[str]:
    port = free_port()
    log = open(tmp_path / "coordinator.log", "wb")
    proc = subprocess.Popen(
        [KVCLI, "coordinator", "--port", str(port), "--instance-timeout", "3"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        assert proc.poll() is None, (tmp_path / "coordinator.log").read_text()
        try:
            if httpx.get(f"{url}/healthz", timeout=0.5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "coordinator did not start"
        time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(10)
    log.close()


def fleet_of(server_factory, coordinator: str, n: int) -> list:
    servers = [
        server_factory("--l1-size-gb", "0.05", "--coordinator", coordinator, "--heartbeat-interval", "0.2", http=True)
        for _ in range(n)
    ]
    deadline = time.monotonic() + 15
    while len(httpx.get(f"{coordinator}/v1/instances", headers=auth_for(coordinator)).json()["instances"]) < n:
        assert time.monotonic() < deadline, "servers did not register"
        time.sleep(0.05)
    return servers


def test_top_once_json_direct(cli: CLI, server_factory, refused_port: int) -> None:
    a = server_factory("--l1-size-gb", "0.05", http=True)
    traffic(a.url)
    gone = f"tcp://127.0.0.1:{refused_port}"
    run = cli("top", "--url", a.url, "--url", a.http_url, "--url", gone, "--json", "--interval", "0.2")
    assert run.code == 0, run.err
    out = run.json()
    by_url = {i["url"]: i for i in out["instances"]}
    assert by_url[a.url]["up"] and by_url[a.http_url]["up"]
    assert by_url[a.url]["hit_rate_total"] == 0.5 and by_url[a.url]["engines"] == 1
    assert by_url[a.url]["ops_s"] == 0.0  # nothing ran between the two polls; our polling is not counted
    assert not by_url[gone]["up"] and "connection refused" in by_url[gone]["reason"]
    assert out["fleet"]["up"] == 2 and out["fleet"]["down"] == 1
    table = cli("top", "--url", a.url, "--url", gone, "--once", "--interval", "0.1")
    assert table.code == 0 and "DOWN" in table.out and "up" in table.out
    assert_one_line_error(cli("top", "--url", gone, "--once", "--interval", "0.1"), "no instance is up")
    assert cli("top", "--url", a.url, "--coordinator", "http://x").code == 2


async def test_top_via_coordinator_once_and_live(cli: CLI, server_factory, coordinator: str) -> None:
    a, b = fleet_of(server_factory, coordinator, 2)
    ida, idb = f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"
    run = cli("top", "--coordinator", coordinator, "--json", "--interval", "0.2")
    assert run.code == 0, run.err
    assert sorted(i["id"] for i in run.json()["instances"]) == sorted([ida, idb])
    assert all(i["up"] for i in run.json()["instances"])
    assert_one_line_error(cli("top", "--coordinator", a.url, "--once"), "speaks HTTP")

    app = TopApp(CoordinatorSource(coordinator), interval=0.3)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: len(app.fleet.views) == 2 and all(v.up for v in app.fleet.views.values()))
        traffic(b.url)
        await until(pilot, lambda: app.fleet.views[idb].hit_rate_total == 0.5)
        b.kill()  # no deregistration: the coordinator still lists it until its heartbeats time out
        await until(pilot, lambda: not app.fleet.views[idb].up)
        assert cells(app, idb)["state"] == "DOWN" and cells(app, ida)["state"] == "up"
        assert "2 instances, 1 down" in screen_text(app)
        assert app.is_running
