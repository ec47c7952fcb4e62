"""An engine fills its arena mapping's page tables right after mapping it (kvprotocol ShmMapping.populate),
so its first saves and loads through each page do not take a page fault: against a real server
started with --prefault, the engine's whole mapping becomes resident without one byte copied."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from engine_kv_helpers import Geometry
from kvconnector.engine_client import EngineClient
from kvhelpers import mapped_rss

GEO = Geometry("vllm_cpu")


def prefaulted(port: int) -> tuple[int, float]:
    """Wait until the server's arena is allocated (it prefaults on a thread of its own); its size and a deadline."""
    seg = Path(f"/dev/shm/kvserver-{port}")
    size = os.stat(seg).st_size
    deadline = time.monotonic() + 30
    while os.stat(seg).st_blocks * 512 < size:
        assert time.monotonic() < deadline, "the server did not prefault its arena within 30 s"
        time.sleep(0.05)
    return size, deadline


def test_an_engine_populates_a_prefaulted_arena(server_factory) -> None:
    srv = server_factory("--l1-size-gb", "0.1", "--chunk-size", "64", "--prefault")
    size, deadline = prefaulted(srv.port)
    with EngineClient(srv.url, "populate/model", 1, 0, [GEO.layout()], mode="shm") as engine:
        assert engine.register(GEO.random_kv(8, seed=1))
        arena = engine._link.arena
        assert arena is not None and arena.size == size
        while mapped_rss(arena.address) < size:
            assert time.monotonic() < deadline, f"{mapped_rss(arena.address)} of {size} bytes mapped after 30 s"
            time.sleep(0.05)


def test_populate_arena_false_leaves_pages_to_their_first_copy(server_factory) -> None:
    srv = server_factory("--l1-size-gb", "0.1", "--chunk-size", "64", "--prefault")
    size, _ = prefaulted(srv.port)
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
