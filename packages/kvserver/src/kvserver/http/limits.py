"""ASGI middleware: cap request bodies and count requests by route template and status.

The body cap counts bytes as they arrive (a lying or absent Content-Length cannot get past it), so a
huge upload is refused with 413 before it is parsed. Counting by route template, not raw path, keeps
the metric's labels bounded.
"""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import Counter
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(HTTPException):
    """Raised from `receive`; an HTTPException so FastAPI's body parsing passes it through as a 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body over {limit} bytes")


class RequestLimits:
    def __init__(self, app: ASGIApp, max_body: int, counter: Counter) -> None:
        self.app, self.max_body, self.counter = app, max_body, counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500, "started": False}
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            await self._too_large(send, status)
            self._count(scope, status["code"])
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise BodyTooLarge(self.max_body)
            return message

        async def tracking_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"], status["started"] = message["status"], True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not status["started"]:
                await self._too_large(send, status)
        self._count(scope, int(status["code"]))

    async def _too_large(self, send: Send, status: dict[str, Any]) -> None:
        body = json.dumps(
            {"error": {"code": "TOO_LARGE", "message": f"request body over {self.max_body} bytes"}}
        ).encode()
        status["code"] = 413
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _count(self, scope: Scope, code: int) -> None:
        route = scope.get("route")
        path = getattr(route, "path", None) or "unmatched"
        self.counter.labels(path, str(code)).inc()
