"""EngineClient and credentials: zero configuration for the server's own user, a refusal is a miss
(never a wrong answer), and a restarted server with a new token is picked up without a restart."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from engine_kv_helpers import Geometry
from kvconnector.engine_client import EngineClient

GEO = Geometry("vllm_cpu", chunk_size=64)


def make_client(server) -> EngineClient:
    return EngineClient(server.url, "auth/model", 1, 0, [GEO.layout()], mode="tcp", timeout=2.0)


def test_engine_reads_the_generated_token_and_follows_a_rotation(server_factory, monkeypatch) -> None:
    monkeypatch.delenv("KVSERVER_API_TOKEN", raising=False)
    server = server_factory("--l1-size-gb", "0.05", "--chunk-size", "64")
    tokens = np.arange(128) + 5
    with make_client(server) as eng:
        assert eng.register(GEO.random_kv(8, seed=3))  # no token configured anywhere: the file serves
        assert eng.save(tokens, list(range(8))).ok
        assert eng.lookup(tokens).hit_tokens == 128
        server.stop()
        token_file = Path(os.environ["KVSERVER_STATE_DIR"]) / f"token-{server.port}"
        old = token_file.read_text()
        token_file.unlink()  # rotation: the restarted server generates a new token
        again = server_factory("--l1-size-gb", "0.05", "--chunk-size", "64", port=server.port)
        assert token_file.read_text() != old
        first = eng.lookup(tokens)  # refused with the stale token: a miss, never an exception
        assert first.hit_tokens == 0
        with again.client() as c:
            assert c.call("describe").result["errors"].get("UNAUTHORIZED", 0) >= 1
        for _ in range(20):  # the link re-read the file; the client re-registers and serves again
            if eng.save(tokens, list(range(8))).ok:
                break
        assert eng.lookup(tokens).hit_tokens == 128
