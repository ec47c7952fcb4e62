"""The engine side of #34 finding 10: a tenant without shm gets tcp in mode "auto" and a clear
error in mode "shm"; a tenant added with --allow-shm maps the arena as before. Real server, real CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from engine_kv_helpers import Geometry
from kvconnector.ec_client import ECClient
from kvconnector.engine_client import EngineClient
from kvtestkit.tenants import add_tenant

GEO = Geometry("vllm_cpu", chunk_size=64)
TOKENS = np.arange(128) + 11


def engine(server: Any, token: str, mode: str) -> EngineClient:
    return EngineClient(server.url, "shm/model", 1, 0, [GEO.layout()], mode=mode, timeout=2.0, token=token)


def test_auto_falls_back_to_tcp_and_shm_is_a_clear_error_without_allow_shm(server_factory: Any, tmp_path: Path):
    tenants = tmp_path / "tenants.json"
    alice, bob = add_tenant(tenants, "alice", "--allow-shm"), add_tenant(tenants, "bob")
    server = server_factory("--l1-size-gb", "0.05", "--chunk-size", "64", "--tenants-file", str(tenants))
    with engine(server, bob, "auto") as eng:
        assert eng.register(GEO.random_kv(8, seed=3))
        assert eng.data_mode == "tcp"  # the server named no arena for bob
        assert eng.save(TOKENS, list(range(8))).ok
        assert eng.lookup(TOKENS).hit_tokens == 128
    with engine(server, bob, "shm") as eng:
        eng.register(GEO.random_kv(8, seed=3))
        saved = eng.save(TOKENS + 1000, list(range(8)))
        assert not saved.ok and saved.error is not None and saved.error.startswith("shm_refused")
        assert "--allow-shm" in saved.error
    with engine(server, alice, "auto") as eng:  # the allowed tenant keeps its shm data plane
        assert eng.register(GEO.random_kv(8, seed=3))
        assert eng.data_mode == "shm"
        assert eng.save(TOKENS, list(range(8))).ok
    ec = ECClient(server.url, "m@0123456789abcdef", "fedcba9876543210", token=bob)  # auto: tcp after a refusal
    try:
        data = np.arange(256, dtype=np.float32)
        assert ec.save("img", data, "float32", [256])
        assert ec.stats.failures == 0
        got = ec.load("img")
        assert got is not None and got[0].tobytes() == data.tobytes()
    finally:
        ec.close()
