"""`POST /v1/fleet/lookup` on a fast path: a router calls it before every request it routes.

FastAPI's generic machinery (routing through every route, dependency resolution, the Request
object, its telemetry hooks) costs a good part of a lookup answered from the index, so an ASGI
middleware answers this one path itself: bearer check, body read, msgspec decode, lookup, msgspec
encode. The FastAPI route stays, serving the same handler, for the OpenAPI schema and for an app
mounted without the middleware. Refusals are the app's usual `{"error": {"code", "message"}}`
replies with the same status codes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import ApiError, error_reply
from .models import LookupBody
from .security import check_bearer

PATH = "/v1/fleet/lookup"
_DECODER = msgspec.json.Decoder(LookupBody)
_JSON_HEADERS = [(b"content-type", b"application/json")]


def decode_lookup(raw: bytes) -> LookupBody:
    """The checked lookup body; ApiError 400 BAD_JSON or 422 BAD_FIELD, kvprotocol ValidationError."""
    try:
        body = _DECODER.decode(raw)
    except msgspec.ValidationError as exc:
        try:  # a shape error found before a syntax error further on is still a syntax error
            msgspec.json.decode(raw)
        except msgspec.DecodeError:
            raise ApiError(400, "BAD_JSON", "request body is not valid JSON") from None
        except RecursionError:
            raise ApiError(400, "BAD_JSON", "request body is nested too deeply") from None
        raise ApiError(422, "BAD_FIELD", str(exc)) from None
    except msgspec.DecodeError:
        raise ApiError(400, "BAD_JSON", "request body is not valid JSON") from None
    except RecursionError:  # msgspec's depth guard: thousands of nested arrays
        raise ApiError(400, "BAD_JSON", "request body is nested too deeply") from None
    body.check()
    return body


class LookupFastPath:
    """ASGI middleware: answer POST /v1/fleet/lookup with `answer(raw body) -> JSON bytes`, pass the rest on."""

    def __init__(self, app: ASGIApp, answer: Callable[[bytes], Awaitable[bytes]], token: str | None) -> None:
        self.app, self.answer, self.token = app, answer, token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != PATH or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            if self.token is not None:
                auth = next((v for k, v in scope["headers"] if k == b"authorization"), None)
                check_bearer(auth.decode("latin-1") if auth is not None else None, self.token)
            parts = []
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                parts.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            content = await self.answer(b"".join(parts))
        except Exception as exc:
            reply = error_reply(exc)
            if reply is None:
                raise  # a bug: the app's 500 handler answers it
            await reply(scope, receive, send)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*_JSON_HEADERS, (b"content-length", str(len(content)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": content})
