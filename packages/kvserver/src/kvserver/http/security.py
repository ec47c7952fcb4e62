"""Bearer-token checks for the admin API.

Health probes are always open. Status and metrics (aggregates, no cache contents) are open while
the API listens on loopback; beyond loopback they need the token too. Key queries (they reveal what
is cached) and mutations need the server's token always: the configured one, or the one generated
into the default 0600 token file.
"""

from __future__ import annotations

from fastapi import Request

from kvprotocol import bearer_refusal, is_loopback

from ..config import ServerConfig
from .errors import ApiError


def check_bearer(request: Request, token: str | None) -> None:
    refusal = bearer_refusal(request.headers.get("authorization"), token)
    if refusal is not None:
        raise ApiError(*refusal, headers={"WWW-Authenticate": "Bearer"} if refusal[0] == 401 else None)


class Guard:
    """FastAPI dependencies for the two access levels, bound to one server's config."""

    def __init__(self, config: ServerConfig, token: str) -> None:
        self.token = token
        self.read_token = None if is_loopback(config.http_host) else token

    def read(self, request: Request) -> None:
        check_bearer(request, self.read_token)

    def write(self, request: Request) -> None:
        check_bearer(request, self.token)
