"""An EngineClient stalled inside a save past its reservation and the slot's quarantine (the chaos
soak's client_stop_mid_write, #40) must still tell the server its copy ended: its abort goes out
with a fresh grace deadline, so the server checks the slot, which by then holds another object, and
drops that object instead of serving it to checksum failures. Real server, real EngineClients."""

from __future__ import annotations

from typing import Any

import numpy as np

from engine_kv_helpers import Geometry
from kvtestkit.kvhelpers import wait_quarantine_over
from kvconnector.engine_client import EngineClient

GEO = Geometry("vllm_cpu")
ARGS = ("--l1-size-gb", "0.05", "--chunk-size", "64", "--lease-ttl", "0.5")


def test_a_writer_stalled_past_its_quarantine_gets_the_object_it_overwrote_dropped(server_factory) -> None:
    server = server_factory(*ARGS)
    lay = GEO.layout()
    victim_tokens = np.arange(5000, 5064)
    with (
        EngineClient(server.url, "stall/model", 1, 0, [lay], mode="shm", timeout=1.0) as writer,
        EngineClient(server.url, "stall/model", 1, 0, [lay], mode="shm", timeout=1.0) as other,
    ):
        assert writer.register(GEO.random_kv(8, seed=1)) and other.register(GEO.random_kv(8, seed=2))
        copier = writer._plane.copier
        gather = copier.gather

        def stalled_gather(*args: Any) -> Any:
            with server.client() as c:
                wait_quarantine_over(c)  # the writer "stops" here, between reservation and copy
            assert other.save(victim_tokens, list(range(4))).ok  # the victim takes the freed slot
            return gather(*args)  # the late copy lands on the victim

        copier.gather = stalled_gather
        assert not writer.save(np.arange(64), list(range(4))).ok
        assert other.lookup(victim_tokens).hit_tokens == 0  # dropped; before the fix: a 64-token hit
        with server.client() as c:
            assert c.call("describe").result["counters"].get("late_write_dropped", 0) == 1
