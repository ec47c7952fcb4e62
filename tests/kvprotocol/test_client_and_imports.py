"""Clients never hang, and kvprotocol never imports torch."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from kvprotocol import AsyncClient, Client, RequestTimeout
from serverproc import free_port


def test_kvprotocol_is_torch_free_in_a_fresh_interpreter():
    code = ("import sys, kvprotocol, kvprotocol._client; kvprotocol.chunk_hashes([1]*512, 256); "
            "bad = [m for m in ('torch', 'kvserver', 'kvconnector') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_sync_client_times_out_without_a_server():
    with Client(f"tcp://127.0.0.1:{free_port()}", timeout=0.3) as c:
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout):
            c.call("ping")
        assert time.monotonic() - t0 < 5


def test_async_client_times_out_without_a_server():
    async def run():
        async with AsyncClient(f"tcp://127.0.0.1:{free_port()}", timeout=0.3) as c:
            await c.call("ping")

    with pytest.raises(RequestTimeout):
        asyncio.run(run())


def test_client_recovers_when_the_server_comes_back(server_factory):
    srv = server_factory("--l1-size-gb", "0.01")
    with srv.client(timeout=0.5) as c:
        assert c.call("ping").result["protocol"] == 1
        srv.kill()
        with pytest.raises(RequestTimeout):
            c.call("ping")
        server_factory("--l1-size-gb", "0.01", port=srv.port)
        deadline = time.monotonic() + 10
        while True:  # stale replies are dropped by id; a fresh request gets its own answer
            try:
                assert c.call("ping").result["protocol"] == 1
                break
            except RequestTimeout:
                assert time.monotonic() < deadline
