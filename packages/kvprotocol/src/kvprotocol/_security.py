"""Bind and token rules shared by kvserver and the coordinator (both speak them; neither imports the other).

A listener beyond loopback needs a token or an explicit `--insecure`; tokens are compared in
constant time.
"""

from __future__ import annotations

import hmac
import ipaddress


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


def exposure_refusal(host: str, flag: str, token_env: str) -> str:
    """The one-line refusal for a non-loopback bind without a token."""
    return (f"refusing to listen on non-loopback address {host} ({flag}) without an API token: set "
            f"--api-token (or {token_env}), bind 127.0.0.1, or pass --insecure to accept an "
            "unauthenticated endpoint")
