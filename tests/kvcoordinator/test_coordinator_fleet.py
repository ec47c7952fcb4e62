"""Real kvservers with --coordinator against a real coordinator: membership through register,
heartbeat, timeout and coordinator restart; fleet status with an instance killed; fleet lookup."""

from __future__ import annotations

import re

import httpx

from kvtestkit.coordproc import CoordinatorProc, wait_for
from kvtestkit.httpkv import CHUNK, fill, keys_body, parse_metrics, prompt, value
from kvtestkit.kvhelpers import register, store, tiny_layout
from kvtestkit.serverproc import ServerProc, free_port

BEAT = ("--heartbeat-interval", "0.2")


def kv(server_factory, coord: CoordinatorProc | str, *args: str, http: bool = True, **kw) -> ServerProc:
    url = coord if isinstance(coord, str) else coord.url
    return server_factory(
        "--l1-size-gb", "0.05", "--chunk-size", str(CHUNK), "--coordinator", url, *BEAT, *args, http=http, **kw
    )


def listed(coord: CoordinatorProc, srv: ServerProc) -> dict | None:
    return next((i for i in coord.instances() if i["zmq_url"] == srv.url), None)


def test_register_heartbeat_deregister_and_timeout(server_factory, coordinator_factory) -> None:
    coord = coordinator_factory("--instance-timeout", "2")
    srv, doomed = kv(server_factory, coord), kv(server_factory, coord)
    inst = wait_for(lambda: listed(coord, srv), what="registration")
    assert inst["http_url"] == srv.http_url and inst["chunk_size"] == CHUNK and inst["liveness"] == "live"
    assert inst["l1_capacity_bytes"] == srv.client().call("describe").result["l1"]["capacity_bytes"]
    wait_for(lambda: (listed(coord, srv) or {}).get("heartbeats", 0) >= 2, what="heartbeats")
    with srv.client() as c:  # heartbeats carry usage and the engines' models
        ks, _ = register(c, model="llama-tiny", layouts=[tiny_layout(CHUNK)])
        store(c, ks, prompt(2), fill)
    wait_for(lambda: (listed(coord, srv) or {}).get("objects") == 2, what="usage in heartbeat")
    assert listed(coord, srv)["models"] == ["llama-tiny"]
    wait_for(lambda: listed(coord, doomed), what="registration")
    doomed.kill()  # no goodbye: only the missing heartbeats tell
    assert srv.stop() == 0
    assert listed(coord, srv) is None  # deregistered on shutdown, not left to time out
    wait_for(lambda: listed(coord, doomed) is None, what="timeout")
    samples = parse_metrics(coord.get("/metrics").text)
    assert value(samples, "kvcoordinator_instance_timeouts_total") == 1
    assert value(samples, "kvcoordinator_deregistrations_total") == 1
    log = coord.log()  # membership changes are logged at INFO, each naming the instance
    for what, who in (("registered", srv), ("registered", doomed), ("deregistered", srv), ("timed out", doomed)):
        assert re.search(rf"INFO kvcoordinator: instance \w+ {what}.*zmq={re.escape(who.url)}", log), (what, log)


def test_coordinator_down_then_restarted(server_factory, coordinator_factory) -> None:
    port = free_port()
    srv = kv(server_factory, f"http://127.0.0.1:{port}")  # nothing listens there yet
    with srv.client() as c:
        assert c.call("ping").result["protocol"] == 1  # serving regardless
    coord = coordinator_factory(port=port)
    # a heartbeat proves the server got its id (not just that the coordinator recorded it)
    first = wait_for(
        lambda: (listed(coord, srv) or {}).get("heartbeats", 0) >= 1 and listed(coord, srv),
        what="registration once the coordinator is up",
    )
    coord.kill()
    with srv.client() as c, httpx.Client(timeout=5) as h:  # the outage changes nothing for clients
        ks, _ = register(c, layouts=[tiny_layout(CHUNK)])
        store(c, ks, prompt(1), fill)
        assert h.get(f"{srv.http_url}/readyz").json() == {"ready": True}
    again = coordinator_factory(port=port)  # a fresh coordinator knows nobody: heartbeats get 404
    healed = wait_for(lambda: listed(again, srv), what="re-registration after restart")
    assert healed["id"] != first["id"]
    assert "registering again" in srv.log()
    assert value(parse_metrics(again.get("/metrics").text), "kvcoordinator_unknown_heartbeats_total") >= 1


def test_an_unregistered_server_retries_sooner_than_its_heartbeat(server_factory, coordinator_factory) -> None:
    """A failed registration is retried with a backoff capped by the heartbeat interval, not after a
    whole interval: a server with rare heartbeats joins as soon as the coordinator answers."""
    port = free_port()
    srv = server_factory(
        "--l1-size-gb", "0.05", "--coordinator", f"http://127.0.0.1:{port}", "--heartbeat-interval", "60", http=True
    )
    wait_for(lambda: "coordinator" in srv.log() and "retrying" in srv.log(), what="a failed registration")
    coord = coordinator_factory(port=port)
    wait_for(lambda: listed(coord, srv), timeout=20, what="registration well before the next heartbeat")


def test_fleet_lookup_and_status_with_an_instance_killed(server_factory, coordinator_factory) -> None:
    coord = coordinator_factory("--instance-timeout", "60", "--fanout-timeout", "5")
    a, b = kv(server_factory, coord), kv(server_factory, coord)
    ids = {s.url: wait_for(lambda s=s: listed(coord, s), what="registration")["id"] for s in (a, b)}
    shared, only_a = prompt(4, seed=1, tail=3), prompt(2, seed=2)
    ks = None
    for srv, n_chunks in ((a, 1), (b, 3)):
        with srv.client() as c:
            ks, _ = register(c, layouts=[tiny_layout(CHUNK)])
            store(c, ks, shared[: n_chunks * CHUNK], fill)
            if srv is a:
                store(c, ks, only_a, fill)
    assert ks is not None
    with httpx.Client(base_url=coord.url, timeout=10, headers=coord.auth) as h:
        hint = h.post("/v1/fleet/lookup", json=keys_body(ks, shared)).json()
        assert hint["best"]["instance_id"] == ids[b.url] and hint["best"]["zmq_url"] == b.url
        assert hint["prefix_tokens"] == hint["best"]["prefix_tokens"] == 3 * CHUNK
        assert {i["zmq_url"]: i["prefix_tokens"] for i in hint["instances"]} == {a.url: CHUNK, b.url: 3 * CHUNK}
        assert h.post("/v1/fleet/lookup", json=keys_body(ks, only_a)).json()["best"]["zmq_url"] == a.url
        miss = h.post("/v1/fleet/lookup", json=keys_body(ks, prompt(2, seed=3))).json()
        assert miss["best"] is None and miss["prefix_tokens"] == 0
        salted = h.post("/v1/fleet/lookup", json=keys_body(ks, shared, salt="other-tenant")).json()
        assert salted["best"] is None  # the salt is forwarded: no cross-tenant hint
        for srv in (a, b):  # routing hints never count as engine lookups on the servers
            assert srv.client().call("describe").result["counters"]["lookups"] == 0

        b.kill()  # still registered (timeout 60 s), no longer answering
        fleet = h.get("/v1/fleet/status").json()
        by_url = {i["zmq_url"]: i for i in fleet["instances"]}
        assert by_url[a.url]["reachable"] is True and by_url[a.url]["error"] is None
        assert by_url[a.url]["status"]["l1"]["objects"] == 3
        assert by_url[b.url]["reachable"] is False and by_url[b.url]["status"] is None
        assert "unreachable" in by_url[b.url]["error"]
        summary = fleet["summary"]
        assert (summary["instances"], summary["reachable"], summary["unreachable"], summary["objects"]) == (2, 1, 1, 3)
        degraded = h.post("/v1/fleet/lookup", json=keys_body(ks, shared)).json()
        assert degraded["best"]["zmq_url"] == a.url and degraded["prefix_tokens"] == CHUNK
        assert {i["zmq_url"]: i["reachable"] for i in degraded["instances"]} == {a.url: True, b.url: False}
        samples = parse_metrics(h.get("/metrics").text)
    assert value(samples, "kvcoordinator_fleet_lookups_total") == 5
    assert value(samples, "kvcoordinator_fleet_lookup_hit_tokens_total") == 3 * CHUNK + 2 * CHUNK + CHUNK
    assert value(samples, "kvcoordinator_fanout_requests_total", endpoint="status", outcome="ok") == 1
    assert value(samples, "kvcoordinator_fanout_requests_total", endpoint="status", outcome="error") == 1
    assert value(samples, "kvcoordinator_fanout_requests_total", endpoint="query", outcome="error") == 1


def test_shared_fleet_token(server_factory, coordinator_factory) -> None:
    token = "fleet-tok-77aa01"
    coord = coordinator_factory(env={"KVSERVER_API_TOKEN": token})
    member = kv(server_factory, coord, env={"KVSERVER_API_TOKEN": token})
    outsider = kv(server_factory, coord, env={"KVSERVER_API_TOKEN": ""})
    wait_for(lambda: listed(coord, member), what="registration with the token")
    wait_for(lambda: "refused us (HTTP 401" in outsider.log(), what="refusal logged")
    assert listed(coord, outsider) is None
    with outsider.client() as c:
        assert c.call("ping").result["protocol"] == 1  # refused by the coordinator, still serving
