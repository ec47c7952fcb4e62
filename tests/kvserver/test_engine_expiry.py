"""Engine registrations expire: a local engine whose process exited leaves describe and the
`kvserver_engines` gauge at the next sweep; one nobody can check (another host) after a silent TTL."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from kvtestkit.httpkv import parse_metrics, value
from kvtestkit.kvhelpers import tiny_layout
from kvprotocol import Client
from kvserver.service.engines import Engine, EngineTable, process_gone

REGISTER = """
import os, socket, sys
from kvprotocol import Client, LayoutDescriptor
lay = LayoutDescriptor("vllm_cpu", "float32", 2, 32, 1024, 256, (256,))
with Client(sys.argv[1]) as c:
    r = c.call("register_engine", model=sys.argv[2], world_size=1, rank=0, groups=[lay.to_wire()],
               host=socket.gethostname(), pid=os.getpid()).result
print(r["engine_id"])
"""


def _engines(client: Client) -> list[dict]:
    return client.call("describe").result["engines"]


def test_an_exited_engine_process_leaves_describe_and_the_gauge(server_factory) -> None:
    srv = server_factory("--l1-size-gb", "0.02", "--lease-ttl", "1", http=True)
    with srv.client() as c:
        c.call(
            "register_engine",
            model="alive",
            world_size=1,
            rank=0,
            groups=[tiny_layout().to_wire()],
            host=socket.gethostname(),
            pid=__import__("os").getpid(),
        )  # this test process: alive
        gone_id = subprocess.run(
            [sys.executable, "-c", REGISTER, srv.url, "exited"], capture_output=True, text=True, check=True, timeout=60
        ).stdout.strip()
        deadline = time.monotonic() + 10
        while any(e["id"] == gone_id for e in _engines(c)):
            assert time.monotonic() < deadline, _engines(c)
            time.sleep(0.1)
        assert [e["model"] for e in _engines(c)] == ["alive"]
    import httpx

    samples = parse_metrics(httpx.get(f"{srv.http_url}/metrics", timeout=5).text)
    assert value(samples, "kvserver_engines") == 1


def test_silent_remote_registrations_expire_after_the_ttl() -> None:
    table = EngineTable(ttl=60)
    layout = [tiny_layout().to_wire()]
    remote = table.add(Engine("e1", "m", 1, 0, layout, "elsewhere", 4242), ["fp"])
    quiet = table.add(Engine("e2", "q", 1, 0, layout, "elsewhere", 0), ["fp"])
    t0 = time.monotonic()
    assert table.expire(t0 + 30) == []
    table.touch("m", 1, now=t0 + 30)  # traffic for model m keeps its engine
    assert table.expire(t0 + 61) == [quiet]
    assert list(table.engines) == [remote]
    assert table.expire(t0 + 91) == [remote]


def test_process_gone_sees_exit_and_pid_reuse() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert process_gone(proc.pid, time.time() - 5)
    import os

    assert not process_gone(os.getpid(), time.time())
    assert process_gone(os.getpid(), 0.0)  # registered "before" this process started: a reused pid


def test_engine_ttl_flag_expires_a_silent_remote_engine(server_factory) -> None:
    srv = server_factory("--l1-size-gb", "0.02", "--engine-ttl", "1")
    with srv.client() as c:
        c.call(
            "register_engine",
            model="far",
            world_size=1,
            rank=0,
            groups=[tiny_layout().to_wire()],
            host="another-host",
            pid=1234,
        )
        assert [e["model"] for e in _engines(c)] == ["far"]
        deadline = time.monotonic() + 10
        while _engines(c):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert c.call("describe").result["config"]["engine_ttl"] == 1.0
