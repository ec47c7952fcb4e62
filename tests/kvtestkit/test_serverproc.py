"""The test kit's server launcher: a port another process took between the pick and the bind costs a
retry on a new port, not a failed test (a parallel suite races for ports all the time)."""

from __future__ import annotations

import socket
from pathlib import Path

from kvtestkit.serverproc import KVServer


def test_a_kvserver_whose_port_was_taken_starts_on_another(tmp_path: Path) -> None:
    server = KVServer(tmp_path / "kvserver.log", "--l1-size-gb", "0.01")
    taken = server.port
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        server.start()
        try:
            assert server.port != taken
            assert server.args[:2] == ["--shm-prefix", f"kvtest{server.port}"]
            with server.client() as c:
                assert c.call("ping")
        finally:
            server.stop()
    assert "Address already in use" in (tmp_path / "kvserver.log").read_text()
