"""The prefix index under missed, out-of-order, malformed and forged events (simulated publishers,
real coordinator process): a claim the instance does not hold never outlives one resync. And which
of many holders a lookup lists."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import zmq

from kvtestkit.coordproc import CoordinatorProc, wait_for
from kvprotocol import chunk_hashes
from kvtestkit.ports import free_port
from kvtestkit.siminstance import SimInstance, plain_auth

CHUNK = 256
MODEL = "sim-model"
GROUPS = ["0123456789abcdef"]


def tokens(n_chunks: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 for i in range(n_chunks * CHUNK)]


def low64(toks: list[int]) -> list[int]:
    return [int.from_bytes(h[-8:], "big") for h in chunk_hashes(toks, CHUNK)]


@pytest.fixture
def zctx(fleet_token: str) -> Iterator[zmq.Context]:
    """The sims' context; their event sockets take the fleet token, as a kvserver's do."""
    ctx = zmq.Context()
    auth = plain_auth(ctx, fleet_token)
    yield ctx
    auth.stop()
    ctx.destroy(linger=0)


@pytest.fixture
def sims(zctx: zmq.Context) -> Iterator[list[SimInstance]]:
    made: list[SimInstance] = []
    yield made
    for sim in made:
        sim.close()


class Coord:
    def __init__(self, proc: CoordinatorProc, token: str | None = None) -> None:
        self.proc = proc
        token = token or proc.token
        self.http = httpx.Client(
            base_url=proc.url,
            timeout=10,
            trust_env=False,
            headers={"Authorization": f"Bearer {token}"} if token else {},
        )

    def lookup(self, toks: list[int], **extra: Any) -> dict[str, Any]:
        body = {"model": MODEL, "world_size": 1, "groups": GROUPS, "tokens": toks, **extra}
        return dict(self.http.post("/v1/fleet/lookup", json=body).json())

    def prefix(self, toks: list[int]) -> int:
        answer = self.lookup(toks)
        assert answer["fanned_out"] == 0 or answer["prefix_tokens"] == 0
        return int(answer["prefix_tokens"]) if answer["fanned_out"] == 0 else -1

    def index(self) -> dict[str, Any]:
        return dict(self.http.get("/v1/fleet/index").json())


def start(
    coordinator_factory: Any, zctx: zmq.Context, sims: list[SimInstance], *args: str, token: str | None = None
) -> tuple[Coord, SimInstance]:
    proc = coordinator_factory("--instance-timeout", "60", *args, env={"KVSERVER_API_TOKEN": token} if token else None)
    coord = Coord(proc, token)
    sim = SimInstance(zctx, f"sim{len(sims)}", CHUNK)
    sims.append(sim)
    assert sim.register(coord.http, proc.url, token).status_code == 201
    wait_for(lambda: coord.index()["synced"] == 1, what="feed in sync")
    return coord, sim


def settle(coord: Coord, sim: SimInstance, toks: list[int], prefix: int) -> None:
    """Store a probe until the index shows it (ZMQ's slow joiner may lose the first batches)."""

    def probe() -> bool:
        if coord.prefix(toks) == prefix:
            return True
        sim.store(MODEL, low64(toks)[: prefix // CHUNK])
        return False

    wait_for(probe, what="index caught up")


def test_a_gap_resyncs_and_drops_claims_the_instance_no_longer_holds(coordinator_factory, zctx, sims) -> None:
    coord, sim = start(coordinator_factory, zctx, sims)
    a, b = tokens(4, 1), tokens(2, 2)
    settle(coord, sim, a, 4 * CHUNK)
    snapshots = sim.snapshots
    # the removal of a's chunks 2-3 is lost; then b is stored: the coordinator sees a gap and resyncs
    sim.remove(MODEL, low64(a)[2:], deliver=False)
    sim.store(MODEL, low64(b))
    wait_for(lambda: coord.prefix(a) == 2 * CHUNK and coord.prefix(b) == 2 * CHUNK, what="resync after gap")
    assert sim.snapshots > snapshots and coord.index()["gaps"] >= 1


def test_a_lost_tail_is_found_by_the_heartbeat_seq(coordinator_factory, zctx, sims) -> None:
    coord, sim = start(coordinator_factory, zctx, sims)
    a = tokens(3, 3)
    settle(coord, sim, a, 3 * CHUNK)
    sim.remove(MODEL, low64(a), deliver=False)  # the last batch is lost and nothing follows it
    assert coord.prefix(a) == 3 * CHUNK  # the index cannot know yet
    for _ in range(2):  # the first heartbeat announces the seq, the next finds the feed still short of it
        assert sim.heartbeat(coord.http, coord.proc.url).status_code == 200
    wait_for(lambda: coord.prefix(a) == 0, what="resync after a lost tail")
    assert coord.index()["tail_losses"] == 1


def test_stale_malformed_and_lying_batches_last_at_most_one_resync(coordinator_factory, zctx, sims) -> None:
    coord, sim = start(coordinator_factory, zctx, sims)
    a, lie, stale = tokens(2, 4), tokens(2, 5), tokens(2, 6)
    settle(coord, sim, a, 2 * CHUNK)
    # out of order: a batch with an old seq is ignored (the snapshot or the stream already had it)
    sim.send(
        MODEL,
        [
            {
                "type": "BlockStored",
                "block_hashes": low64(stale),
                "parent_block_hash": None,
                "token_ids": [],
                "block_size": CHUNK,
                "lora_id": None,
                "medium": "kvserver_l1",
                "lora_name": None,
            }
        ],
        seq=0,
    )
    # a lie in sequence (claims chunks the instance does not hold) is believed until the next resync...
    sim.store(MODEL, low64(lie), claim_only=True)
    wait_for(lambda: coord.prefix(lie) == 2 * CHUNK, what="the claim indexed")
    assert coord.prefix(stale) == 0
    resyncs = coord.index()["resyncs"]
    # ...which a malformed batch (or any gap) forces: the snapshot does not hold the lie
    sim.send(MODEL, [], payload=b"\xc1 not msgpack")
    wait_for(lambda: coord.index()["resyncs"] > resyncs, what="resync after a malformed batch")
    wait_for(lambda: coord.prefix(lie) == 0, what="claim dropped")
    assert coord.prefix(a) == 2 * CHUNK and coord.index()["bad"] >= 1
    # wrong shapes in a well-formed batch: a string hash, a wrong block size
    for bad in (
        {"type": "BlockStored", "block_hashes": ["x"], "block_size": CHUNK, "medium": "kvserver_l1"},
        {"type": "BlockStored", "block_hashes": low64(lie), "block_size": 16, "medium": "kvserver_l1"},
        {"type": "Nonsense"},
    ):
        resyncs = coord.index()["resyncs"]
        sim.send(MODEL, [bad])
        wait_for(lambda r=resyncs: coord.index()["resyncs"] > r, what=f"resync after {bad}")
        assert coord.prefix(lie) == 0 and coord.prefix(a) == 2 * CHUNK


def test_a_restart_on_the_same_endpoint_clears_the_old_claims(coordinator_factory, zctx, sims) -> None:
    coord, sim = start(coordinator_factory, zctx, sims)
    old, new = tokens(2, 7), tokens(1, 8)
    settle(coord, sim, old, 2 * CHUNK)
    sim.restart()  # seq 0, AllBlocksCleared
    sim.store(MODEL, low64(new))
    wait_for(lambda: coord.prefix(new) == CHUNK, what="new process indexed")
    assert coord.prefix(old) == 0


def test_only_credentialed_registrations_feed_the_index(coordinator_factory, zctx, sims, fleet_token) -> None:
    token = fleet_token
    coord, member = start(coordinator_factory, zctx, sims, token=token)
    a = tokens(2, 9)
    settle(coord, member, a, 2 * CHUNK)
    # a forged publisher: it cannot register without the credential, so the coordinator never subscribes
    forger = SimInstance(zctx, "forger", CHUNK)
    sims.append(forger)
    with httpx.Client(trust_env=False) as outsider:
        assert forger.register(outsider, coord.proc.url, "wrong-token").status_code == 403
        assert forger.register(outsider, coord.proc.url, None).status_code == 401
    forged = tokens(2, 10)
    for _ in range(20):
        forger.store(MODEL, low64(forged))
    assert coord.prefix(forged) == 0 and coord.index()["feeds"] == 1
    # nor can it speak on a member's stream: the coordinator connects out, to the endpoint registered
    assert coord.lookup(a)["best"]["instance_id"] == member.instance_id


def test_an_instance_whose_snapshot_fails_is_asked_directly(coordinator_factory, zctx, sims) -> None:
    proc = coordinator_factory("--instance-timeout", "60", "--fanout-timeout", "1")
    coord = Coord(proc)
    sim = SimInstance(zctx, "nosnap", CHUNK)
    sims.append(sim)
    sim.http.shutdown()  # its HTTP side is gone: no snapshot, no /v1/query
    sim.http.server_close()
    assert sim.register(coord.http, proc.url).status_code == 201
    sim.store(MODEL, low64(tokens(2, 11)))  # events alone are never trusted without a sync
    wait_for(lambda: coord.index()["resync_failures"] >= 1, what="a failed resync")
    answer = coord.lookup(tokens(2, 11))
    assert answer["indexed"] == 0 and answer["fanned_out"] == 1 and answer["best"] is None
    assert answer["instances"][0]["reachable"] is False and answer["instances"][0]["source"] == "fanout"
    assert coord.index()["synced"] == 0 and coord.index()["chunks"] == 0


def test_no_sync_before_the_stream_is_connected(coordinator_factory, zctx, sims) -> None:
    """A snapshot taken before the subscription is up would miss what is published meanwhile, with
    no later gap to show it: the feed waits for the handshake with the instance's publisher."""
    coord = Coord(coordinator_factory("--instance-timeout", "60"))
    sim = SimInstance(zctx, "late", CHUNK)
    sims.append(sim)
    sim.endpoint = f"tcp://127.0.0.1:{free_port()}"  # advertised, but nobody listens there yet
    assert sim.register(coord.http, coord.proc.url).status_code == 201
    a = tokens(2, 12)
    sim.store(MODEL, low64(a))  # held, and in the snapshot the coordinator must not take yet
    time.sleep(1.0)  # ample for a snapshot (milliseconds), which the coordinator must not take
    assert sim.snapshots == 0 and coord.index()["synced"] == 0
    assert coord.lookup(a)["fanned_out"] == 1  # asked directly meanwhile
    # the publisher comes up: handshake, then the snapshot. Without PLAIN: the coordinator presents
    # the token only to a socket this user had bound when it registered (credentials.py)
    sim.pub.plain_server = False
    sim.pub.bind(sim.endpoint)
    wait_for(lambda: coord.index()["synced"] == 1, what="feed in sync")
    assert sim.snapshots >= 1 and coord.prefix(a) == 2 * CHUNK
    b = tokens(1, 13)
    sim.store(MODEL, low64(b))  # the stream is live from the snapshot on
    wait_for(lambda: coord.prefix(b) == CHUNK, what="stream applied")


def test_a_lookup_lists_the_least_loaded_of_the_deepest_holders(coordinator_factory, zctx, sims) -> None:
    """More holders than a lookup lists (16): the deepest prefix wins, ties go to the least loaded."""
    coord, first = start(coordinator_factory, zctx, sims)
    a = tokens(2, 12)
    deep = [first]
    for i in range(19):  # 20 instances hold both chunks of a, one only its first (and is the least loaded)
        sim = SimInstance(zctx, f"deep{i}", CHUNK)
        sims.append(sim)
        deep.append(sim)
    shallow = SimInstance(zctx, "shallow", CHUNK)
    sims.append(shallow)
    loads = {sim.name: (i + 1) * (1 << 20) for i, sim in enumerate(reversed(deep))}  # deep[0] the busiest
    loads[shallow.name] = 0
    for sim in [*deep[1:], shallow]:
        reply = coord.http.post("/v1/instances", json={**sim.registration(), "l1_used_bytes": loads[sim.name]})
        assert reply.status_code == 201
        sim.instance_id = reply.json()["instance_id"]
    coord.http.put(
        f"/v1/instances/{first.instance_id}/heartbeat", json={"l1_used_bytes": loads[first.name]}
    ).raise_for_status()
    wait_for(lambda: coord.index()["synced"] == 21, what="every feed in sync")
    hashes = low64(a)

    def indexed() -> bool:
        answer = coord.lookup(a)
        if answer["prefix_tokens"] == 2 * CHUNK and len(answer["instances"]) == 16:
            return True
        for sim in deep:
            sim.store(MODEL, hashes)
        shallow.store(MODEL, hashes[:1])
        return False

    wait_for(indexed, what="all holders indexed")
    answer = coord.lookup(a)
    least = sorted(deep, key=lambda s: loads[s.name])[:16]
    assert {r["instance_id"] for r in answer["instances"]} == {s.instance_id for s in least}
    assert all(r["prefix_tokens"] == 2 * CHUNK and r["source"] == "index" for r in answer["instances"])
    assert answer["best"]["instance_id"] == least[0].instance_id  # not `shallow`, though it is idle
