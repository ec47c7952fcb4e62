"""Clients never hang, and kvprotocol never imports torch."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from kvprotocol import AsyncClient, Client, RequestTimeout
from kvtestkit.serverproc import free_port


def test_kvprotocol_is_torch_free_in_a_fresh_interpreter():
    code = (
        "import sys, kvprotocol, kvprotocol._client; kvprotocol.chunk_hashes([1]*512, 256); "
        "bad = [m for m in ('torch', 'kvserver', 'kvconnector') if m in sys.modules]; print(bad)"
    )
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


def test_a_late_reply_is_dropped_and_multipart_replies_arrive_whole():
    """A peer (a plain ROUTER, not a kvserver) answers the first request only after the client gave up
    on it, then the second at once with a data frame: the client skips the stale reply by its id and
    returns the second's result and frames."""
    import threading

    import msgpack
    import zmq

    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    rids: list[int] = []

    def peer() -> None:
        first = router.recv_multipart()
        second = router.recv_multipart()  # sent once the first timed out
        for ident, header, extra in ((first[0], first[1], []), (second[0], second[1], [b"payload"])):
            rid = msgpack.unpackb(header)["id"]
            rids.append(rid)
            router.send_multipart(
                [ident, msgpack.packb({"v": 1, "id": rid, "ok": True, "result": {"rid": rid}}), *extra]
            )

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout=0.3, token="t") as c:
            with pytest.raises(RequestTimeout):
                c.call("ping")
            reply = c.call("ping", timeout=5)
            thread.join(5)
            first, second = rids  # the stale reply (the first id) came first on the socket
            assert first != second and reply.result == {"rid": second}
            assert [bytes(f) for f in reply.frames] == [b"payload"]
    finally:
        router.close(linger=0)
