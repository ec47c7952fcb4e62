"""Bearer-token checks for the admin API.

Health probes are always open. Status and metrics are open as aggregates while the API listens on
loopback (any local user reaches it, so tenant rows, per-tenant series and engine pids need the
token: views.py); beyond loopback they need the token too. Key queries (they reveal what
is cached) and mutations need the server's token always: the configured one, or the one generated
into the default 0600 token file.
"""

from __future__ import annotations

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from kvprotocol import bearer_refusal, is_loopback

from ..config import ServerConfig
from .errors import ApiError, error_response


def check_bearer(request: Request, token: str | None) -> None:
    refusal = bearer_refusal(request.headers.get("authorization"), token)
    if refusal is not None:
        raise ApiError(*refusal, headers={"WWW-Authenticate": "Bearer"} if refusal[0] == 401 else None)


class Guard:
    """FastAPI dependencies for the access levels, bound to one server's config."""

    def __init__(self, config: ServerConfig, token: str) -> None:
        self.token = token
        self.read_token = None if is_loopback(config.http_host) else token

    async def write(self, request: Request) -> None:
        check_bearer(request, self.token)

    async def full_view(self, request: Request) -> bool:  # async: a sync dependency costs a threadpool hop
        """Whether a status/metrics read holds the token (full view) or is a token-less loopback read
        (aggregates); a wrong token is refused, not downgraded, so a misconfigured scraper notices."""
        if self.read_token is None and not request.headers.get("authorization"):
            return False
        check_bearer(request, self.token)
        return True


class BearerGate:
    """ASGI middleware: refuse a key endpoint without the token before its body is read.

    FastAPI parses a request's JSON body before it runs dependencies, so the `Guard` alone would let
    an unauthenticated client make the server parse megabytes of JSON on its loop first.
    """

    def __init__(self, app: ASGIApp, token: str, paths: frozenset[str]) -> None:
        self.app, self.token, self.paths = app, token, paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") in self.paths:
            header = dict(scope.get("headers") or []).get(b"authorization")
            refusal = bearer_refusal(header.decode("latin-1") if header else None, self.token)
            if refusal is not None:
                status, code, message = refusal
                headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
                await error_response(status, code, message, headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)
