"""ECClient against a real kvserver: both data modes, leased loads, corrupted bytes, a dead server."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvconnector.ec_client import ECClient
from kvtestkit.kvhelpers import ArenaMap

MODEL, SPACE = "tiny-vlm@0123456789abcdef", "fedcba9876543210"


def output(seed: int, rows: int = 64, width: int = 128) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, width), dtype=np.float32)


@pytest.mark.parametrize("mode", ["tcp", "shm", "auto"])
def test_save_then_load_in_every_mode(server: Any, mode: str) -> None:
    ec = ECClient(server.url, MODEL, SPACE, mode=mode)
    x = output(1)
    assert ec.save("img-1", x.view(np.uint8), "float32", list(x.shape))
    assert not ec.save("img-1", x.view(np.uint8), "float32", list(x.shape))  # present: stored once
    assert ec.stats.present == 1
    desc = ec.lookup(["img-1", "img-2"], readers=1)
    assert desc[1] is None and desc[0] is not None and "lease" in desc[0]
    data, dtype, shape = ec.load("img-1", desc[0])  # type: ignore[misc]
    assert dtype == "float32" and shape == [64, 128]
    assert np.array_equal(data.view(np.float32).reshape(shape), x)
    ec.release(desc[0]["lease"])
    got = ec.load("img-1")  # no descriptor: retrieved over tcp
    assert got is not None and np.array_equal(got[0].view(np.float32).reshape(got[2]), x)
    assert ec.load("img-2") is None
    assert ec.stats.failures == 0 and ec.stats.loads == 2
    ec.close()


def test_corrupted_bytes_are_a_miss(server: Any) -> None:
    ec = ECClient(server.url, MODEL, SPACE, mode="shm")
    x = output(2)
    assert ec.save("img-c", x.view(np.uint8), "float32", list(x.shape))
    desc = ec.lookup(["img-c"], readers=1)[0]
    assert desc is not None
    seg = ArenaMap(desc["arena"]["name"], desc["arena"]["size"])
    seg.write(desc["offset"] + 100, b"\xff\xff\xff\xff")  # a torn or foreign write
    seg.close()
    assert ec.load("img-c", desc) is None  # leased shm read: refused
    assert ec.load("img-c") is None  # tcp read of the same bytes: refused
    assert ec.stats.bad_checksums == 2 and ec.stats.loads == 0
    ec.close()


def test_dead_server_is_a_miss_not_an_error(server_factory: Any) -> None:
    srv = server_factory("--l1-size-gb", "0.05")
    ec = ECClient(srv.url, MODEL, SPACE, mode="auto", timeout=0.5, retry_after_s=60)
    srv.stop()
    x = output(3)
    assert not ec.save("img-d", x.view(np.uint8), "float32", list(x.shape))
    assert ec.lookup(["img-d"]) == [None] and ec.load("img-d") is None
    assert ec.stats.failures == 1  # then the breaker skips the server: one timeout, not one per call
    ec.close()
