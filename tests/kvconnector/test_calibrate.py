"""The load planner's start-up calibration (kvconnector/vllm/calibrate.py) against a real kvserver:
one chunk's estimated load cost from pings (its fixed part) and a copy (its part per token), no cache
traffic; None when it cannot measure."""

from __future__ import annotations

from engine_kv_helpers import Geometry, module_server
from kvconnector.engine_client import EngineClient
from kvconnector.vllm.calibrate import calibrate_load
from kvprotocol import Client
from kvtestkit.serverproc import free_port

kv_server = module_server("--l1-size-gb", "0.05", "--chunk-size", "64")


def test_calibration_estimates_one_chunk_and_touches_no_cache(kv_server) -> None:
    geo = Geometry("vllm_cpu")
    lay = geo.layout()
    kv = geo.random_kv(8, seed=3)
    with EngineClient(kv_server.url, "test/model", 1, 0, [lay]) as client:
        assert client.register(kv)
        sample = calibrate_load(client, kv, lay)
    assert sample is not None
    assert sample.tokens == lay.chunk_size and sample.fixed_s > 0 and sample.copy_s > 0
    assert sample.seconds == sample.fixed_s + sample.copy_s
    with Client(kv_server.url) as c:
        counters = c.describe().counters
    assert counters["lookups"] == 0 and counters["stores"] == 0 and counters["retrieves"] == 0


def test_no_estimate_without_a_server() -> None:
    geo = Geometry("vllm_cpu")
    lay = geo.layout()
    kv = geo.random_kv(8, seed=3)
    with EngineClient(f"tcp://127.0.0.1:{free_port()}", "test/model", 1, 0, [lay], timeout=0.3) as client:
        client.register(kv)
        assert client.round_trip() is None
        assert calibrate_load(client, kv, lay) is None


def test_no_estimate_for_tensors_it_cannot_view_flat(kv_server) -> None:
    geo = Geometry("vllm_cpu")
    lay = geo.layout()
    kv = [t.transpose(1, 2) for t in geo.random_kv(8, seed=3)]  # strided views
    with EngineClient(kv_server.url, "test/model", 1, 0, [lay]) as client:
        assert calibrate_load(client, kv, lay) is None
