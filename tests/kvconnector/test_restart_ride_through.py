"""Engines ride through a server restart (#39 item 2): an EngineClient that keeps running while its
server is killed (`kill -9`) and started again on the same port notices the new instance (the
arena's nonce), maps the adopted arena again and registers again on its own; what it saved before
the crash is a hit again once the new server has verified it, loaded byte for byte in shm mode, and
requests made during the gap miss instead of failing the engine."""

from __future__ import annotations

import time

import numpy as np
import torch

from engine_kv_helpers import Geometry
from kvconnector.engine_client import EngineClient
from kvtestkit.kvhelpers import sid

GEO = Geometry("vllm_cpu")
ARGS = ("--l1-size-gb", "0.05", "--chunk-size", "64", "--lease-ttl", "30")


def test_an_engine_gets_hits_again_after_its_server_is_killed_and_restarted(server_factory) -> None:
    first = server_factory(*ARGS)
    lay = GEO.layout()
    tokens = np.arange(128)
    src, dst = GEO.random_kv(8, seed=7), GEO.sentinel_kv(8)
    with (
        EngineClient(first.url, "restart/model", 1, 0, [lay], mode="shm", timeout=2.0) as writer,
        EngineClient(first.url, "restart/model", 1, 0, [lay], mode="shm", timeout=2.0) as reader,
    ):
        assert writer.register(src) and reader.register(dst)
        assert writer.save(tokens, list(range(8))).ok
        first.kill()  # a crash: no goodbye, the arena and its journal stay behind

        gap = reader.lookup(tokens, session=sid("gap"))  # no server: a miss, not an exception
        assert gap.hit_tokens == 0

        server_factory(*ARGS, port=first.port)  # the new server adopts the arena
        deadline, hit, attempt = time.monotonic() + 30, 0, 0
        while hit < 128:
            assert time.monotonic() < deadline, "the engine never got its hit back"
            attempt += 1
            hit = reader.lookup(tokens, session=sid(f"after-{attempt}")).hit_tokens
            if hit < 128:
                time.sleep(0.1)  # the breaker's back-off, the re-registration, the background verify
        res = reader.load(sid(f"after-{attempt}"), tokens, list(range(8)), 0, 128)
        assert res.ok, res.error
        assert reader.data_mode == "shm"  # the adopted arena, mapped again
        assert all(torch.equal(d, s) for d, s in zip(dst, src))
        # the writer's mapping is of the same file with a new nonce: its first save after the restart
        # registers again before it writes, and is stored
        saved = writer.save(np.arange(1000, 1128), list(range(8)))
        assert saved.ok, saved.error
        assert reader.lookup(np.arange(1000, 1128), session=sid("new")).hit_tokens == 128
