"""Tensor parallelism: N EngineClients in separate processes as the ranks of one engine load one
session concurrently; one rank is slow (its copy starts after the lease TTL), and another client
keeps the arena under eviction pressure meanwhile. Every rank gets exactly the stored bytes or a
miss: in shm mode the slow rank's load must fail although its copy ran (on slots that were reused);
in tcp mode its frames are copies taken under the lease, so it gets exactly the stored bytes."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from typing import Any

import numpy as np
import pytest

from kvtestkit.kvhelpers import lookup, payload, register, store, sid
from kvprotocol import KeySpace

WORLD = 3
SLOW_RANK = 1
TTL = 1.0
SLOW_S = 4 * TTL  # the server's sweep (every TTL/4) ends the session well before the slow copy starts
MODEL = "tp/model"
CHUNK, BLOCK, CHUNKS = 64, 16, 4
NBLOCKS = CHUNKS * CHUNK // BLOCK  # blocks [0, 16) are saved, blocks [16, 32) are loaded into


def _rank_main(url: str, rank: int, mode: str, conn: Any) -> None:
    """One engine rank in its own process: saves from blocks [0, 16), loads into [16, 32)."""
    import torch

    from engine_kv_helpers import SENTINEL, Geometry
    from kvconnector.engine_client import EngineClient

    geo = Geometry("vllm_cpu", chunk_size=CHUNK, block_size=BLOCK)
    kv = geo.sentinel_kv(2 * NBLOCKS)
    with EngineClient(url, MODEL, WORLD, rank, [geo.layout()], mode=mode, timeout=60) as client:
        assert client.register(kv)
        if rank == SLOW_RANK:  # the copy of this rank starts after its leases ended
            copier = client._plane.copier
            scatter = copier.scatter

            def slow_scatter(*args: Any) -> Any:
                time.sleep(SLOW_S)
                return scatter(*args)

            copier.scatter = slow_scatter
        conn.send("ready")
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                return
            if cmd[0] == "save":
                _, seed, tokens = cmd
                g = torch.Generator().manual_seed(seed * 100 + rank)
                for layer in kv:
                    layer[:NBLOCKS] = torch.randn(layer[:NBLOCKS].shape, generator=g)
                    layer[NBLOCKS:] = SENTINEL
                conn.send(client.save(tokens, list(range(NBLOCKS))).ok)
            else:
                _, session, tokens = cmd
                res = client.load(session, tokens, list(range(NBLOCKS, 2 * NBLOCKS)), 0, len(tokens))
                exact = all(torch.equal(layer[NBLOCKS + j], layer[j]) for layer in kv for j in range(NBLOCKS))
                conn.send((res.ok, res.error, exact))


def _pressure(url: str, ks: KeySpace, obj: int, stop: threading.Event, counter: list[int]) -> None:
    """Another engine storing new prompts as fast as it can: every unleased object gets evicted."""
    from kvprotocol import Client

    rng = np.random.default_rng(99)
    with Client(url, timeout=30) as c:
        while not stop.is_set():
            tokens = rng.integers(0, 1 << 30, 8 * CHUNK).tolist()
            for rank in range(WORLD):
                store(c, ks, tokens, lambda ch, g: payload(int(rng.integers(1 << 30)), obj), rank=rank)
            counter[0] += 1


@pytest.mark.parametrize("mode", ["shm", "tcp"])
def test_tp_ranks_get_stored_bytes_or_a_miss_under_eviction(server_factory, mode: str) -> None:
    from engine_kv_helpers import Geometry

    lay = Geometry("vllm_cpu", chunk_size=CHUNK, block_size=BLOCK).layout()
    obj = lay.object_bytes
    # room for two sessions' worth of objects: the pressure evicts every unleased object many times
    srv = server_factory(
        "--l1-size-gb", str(2 * CHUNKS * WORLD * obj / (1 << 30)), "--chunk-size", str(CHUNK), "--lease-ttl", str(TTL)
    )
    ctx = mp.get_context("spawn")
    ranks = []
    for rank in range(WORLD):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_rank_main, args=(srv.url, rank, mode, child), daemon=True)
        proc.start()
        ranks.append((proc, parent))
    try:
        for _, conn in ranks:
            assert conn.poll(120) and conn.recv() == "ready"
        ks = KeySpace.from_layouts(MODEL, WORLD, [lay])
        results: dict[int, list[tuple[bool, str | None, bool]]] = {r: [] for r in range(WORLD)}
        pressured = [0]
        rng = np.random.default_rng(5)
        with srv.client() as c:
            register(c, MODEL, [lay], world_size=WORLD)
            for round_ in range(2):
                tokens = rng.integers(0, 1 << 30, CHUNKS * CHUNK).tolist()
                for _, conn in ranks:
                    conn.send(("save", round_, tokens))
                assert all(conn.recv() for _, conn in ranks)
                session = sid(f"tp-{round_}")
                assert lookup(c, ks, tokens, session=session) == CHUNKS * CHUNK  # the scheduler's lookup
                stop = threading.Event()
                before = pressured[0]
                pusher = threading.Thread(target=_pressure, args=(srv.url, ks, obj, stop, pressured))
                for _, conn in ranks:
                    conn.send(("load", session, tokens))
                pusher.start()
                for rank, (_, conn) in enumerate(ranks):
                    assert conn.poll(120)
                    results[rank].append(conn.recv())
                stop.set()
                pusher.join(60)
                assert pressured[0] - before >= 2  # the arena was refilled while the slow rank slept
    finally:
        for proc, conn in ranks:
            if proc.is_alive():
                conn.send(("stop",))
            proc.join(30)
    for rank, outcomes in results.items():
        for ok, error, exact in outcomes:
            assert exact or not ok, f"rank {rank} reported a load with wrong bytes as ok ({error})"
    slow = results[SLOW_RANK]
    if mode == "tcp":  # copies taken under the lease: the stored bytes, however late the scatter
        assert all(ok and exact for ok, _, exact in slow)
        return
    assert all(not ok for ok, _, _ in slow)  # its leases ended before its copy: always a miss
    assert any(not exact for _, _, exact in slow)  # ... and the check mattered: it copied foreign bytes
    # Two defences see it: the scatter's checksum (foreign bytes never match the committed sum) and,
    # when the bytes happen to verify, the release that proves the leases were held through the copy.
    assert all(any(k in (err or "") for k in ("checksum_mismatch", "lease_lost")) for _, err, _ in slow)
    fast = [ok for r, outs in results.items() if r != SLOW_RANK for ok, _, _ in outs]
    assert any(fast)  # the fast ranks' loads are not all misses (the test is not vacuous)
