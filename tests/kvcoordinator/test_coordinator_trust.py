"""The coordinator sends its token only to instances it trusts: a registrant picks its http_url, so
an untrusted host is asked without credentials (and refuses), a --trust-host one gets the token."""

from __future__ import annotations

import socket

import httpx
import pytest

from kvtestkit.coordproc import wait_for

TOKEN = "fleet-trust-tok-5e"


def _non_loopback_address() -> str:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent; this picks the outbound interface
            addr = str(s.getsockname()[0])
    except OSError:
        addr = ""
    if not addr or addr.startswith("127."):
        pytest.skip("no non-loopback address on this host")
    return addr


def _status_of(coord, srv) -> dict:
    def probe():  # type: ignore[no-untyped-def]
        rows = coord.get("/v1/fleet/status").json()["instances"]
        return next((r for r in rows if r["zmq_url"] == srv.url), None)

    return wait_for(probe, what="instance in fleet status")


@pytest.mark.parametrize("trusted", [False, True])
def test_fleet_token_goes_only_to_trusted_hosts(server_factory, coordinator_factory, trusted: bool) -> None:
    addr = _non_loopback_address()
    coord = coordinator_factory(*(["--trust-host", addr] if trusted else []), env={"KVSERVER_API_TOKEN": TOKEN})
    srv = server_factory(
        "--l1-size-gb",
        "0.01",
        "--http-host",
        addr,
        "--coordinator",
        coord.url,
        "--heartbeat-interval",
        "0.2",
        http=True,
        env={"KVSERVER_API_TOKEN": TOKEN},
    )
    row = _status_of(coord, srv)
    assert row["http_url"] == f"http://{addr}:{srv.http_port}"
    if trusted:
        assert row["reachable"] is True and row["status"]["config"]["api_token"] == "<set>"
    else:  # asked without credentials: the instance refuses, the token never left the coordinator
        assert row["reachable"] is False and "HTTP 401" in row["error"]


def test_coordinator_reads_its_token_from_a_file(coordinator_factory, tmp_path) -> None:
    path = tmp_path / "fleet-token"
    path.write_text(TOKEN + "\n")
    coord = coordinator_factory("--api-token-file", str(path), env={})
    body = {
        "zmq_url": "tcp://127.0.0.1:1",
        "http_url": None,
        "l1_capacity_bytes": 1,
        "version": "0",
        "heartbeat_interval": 1.0,
    }
    assert httpx.post(f"{coord.url}/v1/instances", json=body, timeout=5).status_code == 401
    ok = httpx.post(f"{coord.url}/v1/instances", json=body, timeout=5, headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 201, ok.text
