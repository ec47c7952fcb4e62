"""The coordinator over real HTTP (a real `kvcli coordinator` process): membership, auth, bad input."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from kvtestkit.coordproc import CoordinatorProc, wait_for
from kvtestkit.httpkv import Samples, parse_metrics, value
from kvtestkit.serverproc import BIN, free_port

TOKEN = "fleet-tok-81c2d0"


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProc]:
    """One default coordinator (it generates its token) for the tests that only need one; each leaves it empty."""
    coord = CoordinatorProc(free_port(), [], tmp_path_factory.mktemp("coord") / "shared.log").start()
    yield coord
    coord.stop()


def metrics(coord: CoordinatorProc) -> Samples:
    return parse_metrics(coord.get("/metrics").text)


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def registration(port: int = 5555, **extra: object) -> dict[str, object]:
    return {
        "zmq_url": f"tcp://127.0.0.1:{port}",
        "http_url": f"http://127.0.0.1:{port + 1}",
        "version": "0.1.0",
        "l1_capacity_bytes": 1 << 30,
        "chunk_size": 256,
        "heartbeat_interval": 5.0,
        **extra,
    }


def test_register_heartbeat_list_deregister(shared: CoordinatorProc) -> None:
    coord, before = shared, metrics(shared)
    with httpx.Client(base_url=coord.url, timeout=5, headers=coord.auth) as h:
        reg = h.post("/v1/instances", json=registration(models=["llama"]))
        assert reg.status_code == 201
        iid = reg.json()["instance_id"]
        [inst] = coord.instances()
        assert inst["id"] == iid and inst["liveness"] == "live" and inst["models"] == ["llama"]
        assert inst["zmq_url"] == "tcp://127.0.0.1:5555" and inst["heartbeats"] == 0 and inst["last_seen"] > 0
        beat = h.put(f"/v1/instances/{iid}/heartbeat", json={"l1_used_bytes": 4096, "objects": 2})
        assert beat.status_code == 200
        [inst] = coord.instances()
        assert inst["heartbeats"] == 1 and inst["l1_used_bytes"] == 4096 and inst["objects"] == 2
        assert h.put(f"/v1/instances/{iid}/heartbeat").status_code == 200  # an empty heartbeat is fine
        unknown = h.put("/v1/instances/feedfacefeedface/heartbeat", json={})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "UNKNOWN_INSTANCE"
        assert h.delete(f"/v1/instances/{iid}").status_code == 200
        assert coord.instances() == []
        assert h.delete(f"/v1/instances/{iid}").status_code == 404
        assert h.put(f"/v1/instances/{iid}/heartbeat", json={}).status_code == 404  # gone: re-register
    after = metrics(coord)
    assert delta(after, before, "kvcoordinator_registrations_total") == 1
    assert delta(after, before, "kvcoordinator_heartbeats_total") == 2
    assert delta(after, before, "kvcoordinator_unknown_heartbeats_total") == 2
    assert delta(after, before, "kvcoordinator_deregistrations_total") == 1
    assert value(after, "kvcoordinator_instances", liveness="live") == 0


def test_same_server_registering_again_replaces_its_entry(shared: CoordinatorProc) -> None:
    coord = shared
    with httpx.Client(base_url=coord.url, timeout=5, headers=coord.auth) as h:
        first = h.post("/v1/instances", json=registration()).json()["instance_id"]
        second = h.post("/v1/instances", json=registration()).json()["instance_id"]
        other = h.post("/v1/instances", json=registration(port=6000)).json()["instance_id"]
        assert first != second
        assert sorted(i["id"] for i in coord.instances()) == sorted([second, other])
        for iid in (second, other):
            assert h.delete(f"/v1/instances/{iid}").status_code == 200


def test_silent_instances_turn_late_then_time_out(coordinator_factory) -> None:
    coord = coordinator_factory("--instance-timeout", "3")  # late after 1 s, dropped after 3 s
    with httpx.Client(base_url=coord.url, timeout=5, headers=coord.auth) as h:
        h.post("/v1/instances", json=registration(heartbeat_interval=0.1))
        wait_for(lambda: [i for i in coord.instances() if i["liveness"] == "late"], what="liveness late")
        wait_for(lambda: coord.instances() == [], what="instance dropped")
        samples = parse_metrics(h.get("/metrics").text)
    assert value(samples, "kvcoordinator_instance_timeouts_total") == 1


def test_fleet_gauges_sum_heartbeated_usage(shared: CoordinatorProc) -> None:
    coord = shared
    with httpx.Client(base_url=coord.url, timeout=5, headers=coord.auth) as h:
        ids = []
        for port, used in ((5555, 100), (6000, 250)):
            ids.append(h.post("/v1/instances", json=registration(port=port)).json()["instance_id"])
            h.put(f"/v1/instances/{ids[-1]}/heartbeat", json={"l1_used_bytes": used, "objects": 1})
        samples = metrics(coord)
        for iid in ids:
            h.delete(f"/v1/instances/{iid}")
    assert value(samples, "kvcoordinator_fleet_l1_capacity_bytes") == 2 << 30
    assert value(samples, "kvcoordinator_fleet_l1_used_bytes") == 350
    assert value(samples, "kvcoordinator_fleet_objects") == 2
    assert value(samples, "kvcoordinator_instances", liveness="live") == 2
    assert value(samples, "kvcoordinator_build_info", version="0.1.0") == 1


def test_bad_bodies_get_4xx_and_change_nothing(shared: CoordinatorProc) -> None:
    coord = shared
    json_headers = {"content-type": "application/json"}
    lookup = {"model": "m", "world_size": 1, "groups": ["0123456789abcdef"], "tokens": [1]}
    with httpx.Client(base_url=coord.url, timeout=5, headers=coord.auth) as h:
        assert h.post("/v1/fleet/lookup", json=lookup).status_code == 200  # the valid body the cases change
        iid = h.post("/v1/instances", json=registration()).json()["instance_id"]
        cases = [
            (h.post("/v1/instances", content=b"{oops", headers=json_headers), 400, "BAD_JSON"),
            (
                h.post("/v1/instances", json={k: v for k, v in registration().items() if k != "zmq_url"}),
                422,
                "BAD_FIELD",
            ),
            (h.post("/v1/instances", json=registration(zmq_url="http://x:1")), 422, "BAD_FIELD"),
            (h.post("/v1/instances", json=registration(http_url="file:///etc/passwd")), 422, "BAD_FIELD"),
            (h.post("/v1/instances", json=registration(l1_capacity_bytes=-1)), 422, "BAD_FIELD"),
            (h.post("/v1/instances", json=registration(secret="x")), 422, "BAD_FIELD"),
            (h.put(f"/v1/instances/{iid}/heartbeat", json={"objects": "many"}), 422, "BAD_FIELD"),
            (
                h.post("/v1/fleet/lookup", json={"model": "m", "world_size": 1, "groups": ["nothex"], "tokens": [1]}),
                422,
                "BAD_FIELD",
            ),
            (h.post("/v1/fleet/lookup", content=b" " * (33 << 20), headers=json_headers), 413, "TOO_LARGE"),
            (h.post("/v1/fleet/lookup", content=b"{oops", headers=json_headers), 400, "BAD_JSON"),
            (h.post("/v1/fleet/lookup", content=b"[" * 5000 + b"]" * 5000, headers=json_headers), 400, "BAD_JSON"),
            (
                h.post(
                    "/v1/fleet/lookup", content=b'{"tokens": ' + b"[" * 5000 + b"]" * 5000 + b"}", headers=json_headers
                ),
                400,
                "BAD_JSON",
            ),
            (
                h.post("/v1/fleet/lookup", content=b'{"model": 1, "tokens": [1,', headers=json_headers),
                400,
                "BAD_JSON",
            ),  # a type error before a syntax error is still bad JSON
            *[
                (h.post("/v1/fleet/lookup", json={**lookup, **change}), 422, "BAD_FIELD")
                for change in (
                    {"tokens": [-1]},
                    {"tokens": [1 << 32]},
                    {"tokens": [True]},
                    {"tokens": [1.5]},
                    {"tokens": None},
                    {"tokens": "not base64!"},
                    {"tokens": base64.b64encode(b"12345").decode()},  # not whole uint32s
                    {"world_size": 0},
                    {"world_size": "1"},
                    {"groups": []},
                    {"mode": "nope"},
                    {"secret": 1},
                    {"model": ""},
                )
            ],
            (h.post("/v1/fleet/lookup", json={k: v for k, v in lookup.items() if k != "tokens"}), 422, "BAD_FIELD"),
            (h.get("/v1/nothing"), 404, "NOT_FOUND"),
        ]
        for resp, status, code in cases:
            assert resp.status_code == status, resp.text
            assert resp.json()["error"]["code"] == code and resp.json()["error"]["message"]
    [inst] = coord.instances()
    assert inst["id"] == iid and inst["heartbeats"] == 0
    assert httpx.delete(f"{coord.url}/v1/instances/{iid}", headers=coord.auth).status_code == 200


def test_token_guards_membership_changes(coordinator_factory) -> None:
    coord = coordinator_factory(env={"KVSERVER_API_TOKEN": TOKEN})
    with httpx.Client(base_url=coord.url, timeout=5) as h:
        missing = h.post("/v1/instances", json=registration())
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert h.post("/v1/instances", json=registration(), headers={"Authorization": "Bearer nope"}).status_code == 403
        for path in ("/v1/instances", "/v1/fleet/status", "/v1/fleet/index"):  # reads need it too, even on loopback
            assert h.get(path).status_code == 401, path
        assert (
            h.post(
                "/v1/fleet/lookup", json={"model": "m", "world_size": 1, "groups": ["0123456789abcdef"], "tokens": [1]}
            ).status_code
            == 401
        )
        assert h.get("/metrics").status_code == 200  # aggregates only: a local Prometheus needs no setup
        assert coord.instances() == []
        auth = {"Authorization": f"Bearer {TOKEN}"}
        iid = h.post("/v1/instances", json=registration(), headers=auth).json()["instance_id"]
        assert h.put(f"/v1/instances/{iid}/heartbeat", json={}).status_code == 401
        assert h.delete(f"/v1/instances/{iid}").status_code == 401
        assert h.put(f"/v1/instances/{iid}/heartbeat", json={}, headers=auth).status_code == 200
        assert h.delete(f"/v1/instances/{iid}", headers=auth).status_code == 200
        for path in ("/v1/instances", "/metrics", "/v1/fleet/status", "/openapi.json"):
            assert TOKEN not in h.get(path).text


def test_off_loopback_reads_need_the_token_too(coordinator_factory) -> None:
    coord = coordinator_factory("--host", "0.0.0.0", "--api-token", TOKEN, env={})
    assert coord.get("/healthz").status_code == 200
    assert coord.get("/v1/instances").status_code == 401
    assert coord.get("/metrics").status_code == 401
    assert coord.get("/v1/instances", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_non_loopback_bind_without_token_is_refused(coordinator_factory) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVSERVER_API_TOKEN"}
    cmd = [str(BIN / "kvcli"), "coordinator", "--host", "0.0.0.0", "--port", str(free_port())]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env)
    assert done.returncode == 2
    assert "refusing to listen on non-loopback address 0.0.0.0" in done.stderr and "--insecure" in done.stderr
    coord = coordinator_factory("--host", "0.0.0.0", "--insecure", env={})
    assert coord.get("/v1/instances").status_code == 200


def test_busy_port_is_a_clear_error(shared: CoordinatorProc) -> None:
    first = shared
    done = subprocess.run(
        [str(BIN / "kvcli"), "coordinator", "--port", str(first.port)], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 1 and f"cannot listen on 127.0.0.1:{first.port}" in done.stderr


def test_coordinator_imports_no_torch_or_kvserver() -> None:
    code = (
        "import sys, kvcoordinator.app, kvcoordinator.cli, kvcli._commands.coordinator; "
        "bad = [m for m in ('torch', 'kvserver', 'kvconnector') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_help_lists_options() -> None:
    out = subprocess.run(
        [str(BIN / "kvcli"), "coordinator", "--help"], capture_output=True, text=True, timeout=30
    ).stdout
    for option in ("--host", "--port", "--instance-timeout", "--api-token", "--insecure", "9090"):
        assert option in out


def test_kvcoordinator_is_the_same_command() -> None:
    out = subprocess.run([str(BIN / "kvcoordinator"), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("Usage: kvcoordinator [OPTIONS]")
    refused = subprocess.run(
        [str(BIN / "kvcoordinator"), "--host", "0.0.0.0", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert refused.returncode == 2 and refused.stderr.startswith("kvcoordinator: ")
