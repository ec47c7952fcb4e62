"""One error shape for every HTTP failure: `{"error": {"code", "message"}}` with a 4xx/5xx status.

The server's own errors (kvserver.errors) and kvprotocol's validation errors get their code from the
same `wire_error` as a ZMQ reply, and their status from STATUS_OF_CODE here: the one place HTTP maps
errors. FastAPI's own validation problems are turned into the same shape, so clients see the same
codes over HTTP as over ZMQ and never a stack trace.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvprotocol import MAX_TOKENS, ErrorCode, ValidationError

from ..errors import KVServerError, wire_error

log = logging.getLogger("kvserver.http")

STATUS_OF_CODE = {
    ErrorCode.TOO_LARGE: 413,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.LAYOUT_MISMATCH: 409,
    ErrorCode.NO_SPACE: 507,
    ErrorCode.INTERNAL: 500,
}


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


def _describe_validation(exc: RequestValidationError) -> tuple[int, str, str]:
    errors: list[dict[str, Any]] = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        return 400, "BAD_JSON", "request body is not valid JSON"
    if any(e.get("type") == "too_long" and "tokens" in e.get("loc", ()) for e in errors):
        return 413, str(ErrorCode.TOO_LARGE), f"more than {MAX_TOKENS} tokens"
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body"
        parts.append(f"{loc}: {e.get('msg', 'invalid')}")
    return 422, str(ErrorCode.BAD_FIELD), "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.message, exc.headers)

    async def _kv(_: Request, exc: Exception) -> JSONResponse:
        code, message = wire_error(exc) or (ErrorCode.INTERNAL, type(exc).__name__)
        return error_response(STATUS_OF_CODE.get(code, 422), str(code), message)

    app.add_exception_handler(KVServerError, _kv)
    app.add_exception_handler(ValidationError, _kv)

    @app.exception_handler(RequestValidationError)
    async def _fields(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(*_describe_validation(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED", 413: "TOO_LARGE"}.get(exc.status_code, "HTTP_ERROR")
        return error_response(exc.status_code, code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("HTTP handler failed")
        return error_response(500, str(ErrorCode.INTERNAL), type(exc).__name__)
