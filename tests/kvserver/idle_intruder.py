"""Run as another OS user by test_idle_connections.py: open many connections that never send a
request (raw TCP, and HTTP heads left unfinished), then report how many the server closed.

argv: zmq_port http_port count deadline_s. Prints one JSON line: {"opened", "closed"}.
"""

from __future__ import annotations

import json
import select
import socket
import sys
import time


def main() -> None:
    zmq_port, http_port, count, deadline_s = (int(a) for a in sys.argv[1:5])
    socks: list[socket.socket] = []
    for i in range(count):
        for port in (zmq_port, http_port):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            if port == http_port and i % 2:
                s.sendall(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
            socks.append(s)
    print(json.dumps({"opened": len(socks)}), flush=True)
    open_ = set(socks)
    deadline = time.monotonic() + deadline_s
    while open_ and time.monotonic() < deadline:
        ready, _, _ = select.select(list(open_), [], [], 0.5)
        for s in ready:
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            if not data:  # closed by the server
                open_.discard(s)
    print(json.dumps({"opened": len(socks), "closed": len(socks) - len(open_)}), flush=True)
    time.sleep(0.2)


if __name__ == "__main__":
    main()
