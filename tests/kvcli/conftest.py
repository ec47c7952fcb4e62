"""kvcli test helpers: run commands in-process (click's runner) and parse their JSON."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from click.testing import CliRunner

from kvcli.main import main
from kvcli_testutil import CLI, Run


@pytest.fixture
def cli() -> CLI:
    def run(*args: str) -> Run:
        return Run(CliRunner().invoke(main, list(args), catch_exceptions=False))

    return run


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A TCP port that accepts connections but never speaks (a hung or foreign service)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield s.getsockname()[1]


@pytest.fixture
def refused_port() -> int:
    """A port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def zmq_impostor() -> Iterator[Callable[[dict[str, Any]], str]]:
    """A ZMQ ROUTER answering every request with a fixed reply map (e.g. another protocol version)."""
    import msgpack
    import zmq

    ctx = zmq.Context()
    stop = threading.Event()
    threads = []

    def start(reply: dict[str, Any]) -> str:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port("tcp://127.0.0.1")

        def serve() -> None:
            while not stop.is_set():
                if sock.poll(50):
                    ident, header, *_ = sock.recv_multipart()
                    rid = msgpack.unpackb(header)["id"]
                    sock.send_multipart([ident, msgpack.packb({"id": rid, **reply}, use_bin_type=True)])
            sock.close()

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        threads.append(t)
        return f"tcp://127.0.0.1:{port}"

    yield start
    stop.set()
    for t in threads:
        t.join(2)
    ctx.term()
