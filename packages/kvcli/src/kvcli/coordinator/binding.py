"""The bind rule and the listening socket, importable without FastAPI so refusals are instant.

A non-loopback bind needs a token or an explicit --insecure, as for kvserver. The socket is bound
before the app is built, so a busy port is a one-line error rather than a stack trace.
"""

from __future__ import annotations

import socket

from kvprotocol import exposure_refusal, is_loopback


def exposure_problem(host: str, token: str | None, insecure: bool) -> str | None:
    if token or insecure or is_loopback(host):
        return None
    return exposure_refusal(host, "--host", "KVCLI_COORDINATOR_API_TOKEN")


def bind(host: str, port: int) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(512)
    except OSError:
        sock.close()
        raise
    return sock
