"""Bind and token rules shared by kvserver and the coordinator (both speak them; neither imports the other).

A listener beyond loopback needs a token or an explicit `--insecure`; tokens are compared in
constant time.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def tokens_equal(given: str, token: str) -> bool:
    return hmac.compare_digest(given.encode(), token.encode())


def bearer_matches(header: str | None, token: str) -> bool:
    """Does an `Authorization: Bearer <token>` header carry `token`?"""
    if not header:
        return False
    scheme, _, value = header.partition(" ")
    return scheme.lower() == "bearer" and bool(value) and tokens_equal(value.strip(), token)


def bearer_refusal(header: str | None, token: str | None) -> tuple[int, str, str] | None:
    """Why a request with this Authorization header is refused, as (HTTP status, code, message), or None."""
    if token is None:
        return None
    if not header:
        return 401, "UNAUTHORIZED", "this endpoint needs 'Authorization: Bearer <token>'"
    if not bearer_matches(header, token):
        return 403, "FORBIDDEN", "invalid bearer token"
    return None


def listen_socket(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A bound, listening TCP socket: binding before any app starts makes a busy port a one-line error.

    The protocol must be IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only
    when `sock.proto == IPPROTO_TCP`, and without it Nagle's algorithm holds a reply's last segment
    until the client's delayed ACK (~40 ms per HTTP request on Linux).
    """
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def exposure_refusal(host: str, flag: str, token_env: str) -> str:
    """The one-line refusal for a non-loopback bind without a token."""
    return (
        f"refusing to listen on non-loopback address {host} ({flag}) without an API token: set "
        f"--api-token (or {token_env}), bind 127.0.0.1, or pass --insecure to accept an "
        "unauthenticated endpoint"
    )
