"""One error shape, `{"error": {"code", "message"}}`, for every coordinator failure."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvprotocol import ValidationError

log = logging.getLogger("kvcoordinator")


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


def api_reply(exc: ApiError) -> JSONResponse:
    return error_response(exc.status, exc.code, exc.message, exc.headers)


def kv_reply(exc: ValidationError) -> JSONResponse:
    return error_response(413 if exc.code == "TOO_LARGE" else 422, str(exc.code), exc.message)


def http_reply(exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED", 413: "TOO_LARGE"}.get(exc.status_code, "HTTP_ERROR")
    return error_response(exc.status_code, code, str(exc.detail), getattr(exc, "headers", None))


def error_reply(exc: Exception) -> JSONResponse | None:
    """The reply for a refusal raised outside FastAPI's handlers (the lookup fast path); None: a bug."""
    if isinstance(exc, ApiError):
        return api_reply(exc)
    if isinstance(exc, ValidationError):
        return kv_reply(exc)
    if isinstance(exc, StarletteHTTPException):
        return http_reply(exc)
    return None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return api_reply(exc)

    @app.exception_handler(ValidationError)
    async def _kv(_: Request, exc: ValidationError) -> JSONResponse:
        return kv_reply(exc)

    @app.exception_handler(RequestValidationError)
    async def _fields(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors: list[dict[str, Any]] = list(exc.errors())
        if any(e.get("type") == "json_invalid" for e in errors):
            return error_response(400, "BAD_JSON", "request body is not valid JSON")
        parts = [
            ".".join(str(p) for p in e.get("loc", ()) if p != "body") + f": {e.get('msg', 'invalid')}"
            for e in errors[:5]
        ]
        return error_response(422, "BAD_FIELD", "; ".join(parts))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return http_reply(exc)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("coordinator handler failed")
        return error_response(500, "INTERNAL", type(exc).__name__)
