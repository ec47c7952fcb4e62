"""EngineClients of one process share one mapping of the server's arena (kvconnector._link.SharedArenas):
a vLLM worker's step and loader clients then page-table the arena once, and on a GPU register it for
DMA once. Against a real kvserver: the same address, a client that closes leaves the other copying,
and a restarted server's new arena is a new mapping."""

from __future__ import annotations

import itertools

import numpy as np

from engine_kv_helpers import Geometry, module_server
from kvconnector._link import ARENAS
from kvconnector.engine_client import EngineClient
from kvtestkit.kvhelpers import sid
from kvtestkit.serverproc import ServerProc

kv_server = module_server("--l1-size-gb", "0.05", "--chunk-size", "64", "--lease-ttl", "30")
_seeds = itertools.count(1)


def _client(url: str, geo: Geometry) -> EngineClient:
    return EngineClient(url, "test/model", 1, 0, [geo.layout()], mode="shm")


def _tokens() -> np.ndarray:
    return np.random.default_rng(next(_seeds) * 7_919).integers(0, 50_000, 2 * 64)


def test_two_clients_share_one_mapping_and_the_last_one_unmaps_it(kv_server) -> None:
    geo = Geometry("vllm_cpu")
    a, b = _client(kv_server.url, geo), _client(kv_server.url, geo)
    assert a.register(geo.random_kv(8, seed=1)) and b.register(geo.sentinel_kv(8))
    arena = a._plane.link.arena
    assert arena is not None and b._plane.link.arena is arena and ARENAS.users(arena) == 2
    a.close()
    assert ARENAS.users(arena) == 1 and arena._mm is not None  # still mapped for b
    prompt = _tokens()
    with _client(kv_server.url, geo) as c:
        assert c.register(geo.random_kv(8, seed=2)) and c._plane.link.arena is arena
        assert c.save(prompt, list(range(8))).saved_chunks == 2
    assert b.lookup(prompt, session=sid("share")).hit_tokens == 128
    assert b.load(sid("share"), prompt, list(range(8)), skip_tokens=0, num_tokens=128).ok  # b copies through it
    b.close()
    assert ARENAS.users(arena) == 0 and arena._mm is None


def test_a_restarted_server_s_new_arena_is_a_new_mapping(server_factory) -> None:
    geo = Geometry("vllm_cpu")
    srv: ServerProc = server_factory("--l1-size-gb", "0.05", "--chunk-size", "64", "--cold")
    with _client(srv.url, geo) as a:
        assert a.register(geo.random_kv(8, seed=3))
        old = a._plane.link.arena
        srv.stop()
        srv.start()  # --cold: a new arena file on the same name
        prompt = _tokens()
        assert a.save(prompt, list(range(8))).saved_chunks == 2  # re-registers and maps the new arena
        new = a._plane.link.arena
        assert new is not None and new is not old and old is not None and old._mm is None
        assert ARENAS.users(new) == 1 and ARENAS.users(old) == 0
