"""Bearer-token checks for the admin API.

Health probes are always open. Read-only endpoints are open while the API listens on loopback;
once it listens on a network address (which needs a token or `--insecure`), they need the token too.
Mutating endpoints need the token whenever one is configured.
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

    def __init__(self, config: ServerConfig) -> None:
        self.token = config.api_token
        self.read_token = None if is_loopback(config.http_host) else config.api_token

    def read(self, request: Request) -> None:
        check_bearer(request, self.read_token)

    def write(self, request: Request) -> None:
        check_bearer(request, self.token)
