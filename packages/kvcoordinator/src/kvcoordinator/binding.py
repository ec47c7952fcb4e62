"""The coordinator's bind rule, importable without FastAPI so refusals are instant.

A non-loopback bind needs a token or an explicit --insecure, as for kvserver.
"""

from __future__ import annotations

from kvprotocol import exposure_refusal, is_loopback


def exposure_problem(host: str, token: str | None, insecure: bool) -> str | None:
    if token or insecure or is_loopback(host):
        return None
    return exposure_refusal(host, "--host", "KVSERVER_API_TOKEN")
