"""Bearer-token checks for the admin API.

Health probes are always open. Read-only endpoints are open while the API listens on loopback;
once it listens on a network address (which needs a token or `--insecure`), they need the token too.
Mutating endpoints need the token whenever one is configured.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from ..config import ServerConfig, is_loopback
from .errors import ApiError


def token_matches(header: str | None, token: str) -> bool:
    """Constant-time compare of an `Authorization: Bearer <token>` header with the configured token."""
    if not header:
        return False
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value:
        return False
    return hmac.compare_digest(value.strip().encode(), token.encode())


def check_bearer(request: Request, token: str | None) -> None:
    if token is None:
        return
    header = request.headers.get("authorization")
    if not header:
        raise ApiError(401, "UNAUTHORIZED", "this endpoint needs 'Authorization: Bearer <token>'",
                       headers={"WWW-Authenticate": "Bearer"})
    if not token_matches(header, token):
        raise ApiError(403, "FORBIDDEN", "invalid bearer token")


class Guard:
    """FastAPI dependencies for the two access levels, bound to one server's config."""

    def __init__(self, config: ServerConfig) -> None:
        self.token = config.api_token
        self.read_token = None if is_loopback(config.http_host) else config.api_token

    def read(self, request: Request) -> None:
        check_bearer(request, self.read_token)

    def write(self, request: Request) -> None:
        check_bearer(request, self.token)
