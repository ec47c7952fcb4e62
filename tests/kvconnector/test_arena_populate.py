"""An engine fills its arena mapping's page tables right after mapping it (kvprotocol ShmMapping.populate),
so its first saves and loads through each page do not take a page fault: against a real server
started with --prefault, the engine's whole mapping becomes resident without one byte copied."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from engine_kv_helpers import Geometry
from kvconnector.engine_client import EngineClient
from kvtestkit.kvhelpers import mapped_rss, wait_allocated

GEO = Geometry("vllm_cpu")


def test_an_engine_populates_a_prefaulted_arena(server_factory) -> None:
    srv = server_factory("--l1-size-gb", "0.1", "--chunk-size", "64", "--prefault")
    size = wait_allocated(Path(f"/dev/shm/kvserver-{srv.port}"))
    deadline = time.monotonic() + 30
    with EngineClient(srv.url, "populate/model", 1, 0, [GEO.layout()], mode="shm") as engine:
        assert engine.register(GEO.random_kv(8, seed=1))
        arena = engine._link.arena
        assert arena is not None and arena.size == size
        while mapped_rss(arena.address) < size:
            assert time.monotonic() < deadline, f"{mapped_rss(arena.address)} of {size} bytes mapped after 30 s"
            time.sleep(0.05)


def test_populate_arena_false_leaves_pages_to_their_first_copy(server_factory) -> None:
    srv = server_factory("--l1-size-gb", "0.1", "--chunk-size", "64", "--prefault")
    size = wait_allocated(Path(f"/dev/shm/kvserver-{srv.port}"))
    with EngineClient(srv.url, "populate/model", 1, 0, [GEO.layout()], mode="shm", populate_arena=False) as engine:
        assert engine.register(GEO.random_kv(8, seed=1))
        arena = engine._link.arena
        assert arena is not None
        time.sleep(1.0)  # populating 100 MiB takes about 10 ms here
        assert mapped_rss(arena.address) < size // 8


def test_populate_arena_is_a_connector_option() -> None:
    from kvconnector.vllm.config import parse_config

    assert parse_config({}).populate_arena is True
    assert parse_config({"populate_arena": False}).populate_arena is False
    with pytest.raises(ValueError, match="populate_arena"):
        parse_config({"populate_arena": "no"})
