"""Bind and token rules of the coordinator, the same as kvserver's.

A non-loopback bind needs a token (or an explicit --insecure); on loopback a token is generated
when none is configured, as for kvserver. Every endpoint but /healthz needs it (a fleet lookup or
status answered with the coordinator's own credentials must not serve a stranger); /metrics
(aggregates only) is open on loopback so a local Prometheus needs no setup.
The primitives live in kvprotocol, shared with kvserver.
"""

from __future__ import annotations

from fastapi import Request

from kvprotocol import bearer_refusal, is_loopback

from .errors import ApiError


def check_bearer(authorization: str | None, token: str | None) -> None:
    """Raise the 401/403 ApiError a request with this Authorization header gets (none without a token)."""
    refusal = bearer_refusal(authorization, token)
    if refusal is not None:
        raise ApiError(*refusal, headers={"WWW-Authenticate": "Bearer"} if refusal[0] == 401 else None)


class Guard:
    def __init__(self, host: str, token: str | None) -> None:
        self.token = token
        self.metrics_token = None if is_loopback(host) else token

    async def read(self, request: Request) -> None:  # async: a sync dependency costs a threadpool hop
        check_bearer(request.headers.get("authorization"), self.token)

    async def metrics(self, request: Request) -> None:
        check_bearer(request.headers.get("authorization"), self.metrics_token)

    async def write(self, request: Request) -> None:
        check_bearer(request.headers.get("authorization"), self.token)
