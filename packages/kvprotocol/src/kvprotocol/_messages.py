"""Decoding and checking request frames against the typed definitions in `_requests.py`.

Requests are msgpack maps `{"v", "id", "op", ...fields}`; replies are `{"id", "ok", "result"}` or
`{"id", "ok": False, "error": {"code", "message"}}` (_envelope.py). Data for tcp mode rides as extra ZMQ frames.

A well-formed frame is decoded in one step straight into its Struct (the hot path). Anything else is
decoded again slowly to say exactly what is wrong, with the same error codes as always: the envelope
first (BAD_FRAME, BAD_VERSION, UNKNOWN_OP), then the op's fields (BAD_FIELD, OUT_OF_RANGE, TOO_LARGE).
"""

from __future__ import annotations

import re
from typing import Any

import msgpack
import msgspec

from ._envelope import error_reply, ok_reply
from ._errors import ErrorCode, ValidationError
from ._requests import (
    MAX_CHECKSUMS,
    MAX_CHUNKS,
    MAX_HEADER_BYTES,
    MAX_ID,
    MAX_KEYS,
    MAX_TOKENS,
    MODES,
    PROTOCOL_VERSION,
    REQUESTS,
    U64_MAX,
    AnyRequest,
    Request,
)

__all__ = [
    "MAX_CHECKSUMS",
    "MAX_CHUNKS",
    "MAX_HEADER_BYTES",
    "MAX_ID",
    "MAX_KEYS",
    "MAX_TOKENS",
    "MODES",
    "PROTOCOL_VERSION",
    "SCHEMA",
    "U64_MAX",
    "decode_request",
    "error_reply",
    "ok_reply",
    "pack",
    "request_id_of",
    "unpack_header",
    "validate_request",
]

SCHEMA: dict[str, type[Request]] = REQUESTS  # op name -> its request Struct
_DECODER = msgspec.msgpack.Decoder(AnyRequest)
_RANGE_RE = re.compile(r"Expected `(int|float)` [<>]=? ")


def _code_of(exc: msgspec.ValidationError) -> ErrorCode:
    """msgspec's message -> our code: a number outside its bounds is OUT_OF_RANGE, tokens over their
    bound TOO_LARGE, anything else (type, missing or unknown field, pattern, length) BAD_FIELD."""
    text = str(exc)
    if _RANGE_RE.match(text):
        return ErrorCode.OUT_OF_RANGE
    if text.startswith("Expected `bytes` of length <=") and text.endswith("$.tokens`"):
        return ErrorCode.TOO_LARGE
    return ErrorCode.BAD_FIELD


_HINTS = (
    ("groups", "layout fingerprints are 16 lowercase hex chars"),
    ("model", "model name must be 1-200 chars of [A-Za-z0-9._/:@+-]"),
    ("salt", "cache salt must be 0-128 chars of [A-Za-z0-9._:@+=/-]"),
    (
        "session",
        "session ids must be 22-128 chars of [A-Za-z0-9_-], 128 random bits or more (kvprotocol.new_session_id())",
    ),
)


def coded(exc: msgspec.ValidationError, op: str) -> ValidationError:
    """A msgspec validation failure as our ValidationError: code, and a hint where a regex failed."""
    text = str(exc)
    if "matching regex" in text:
        path = text.rsplit("$.", 1)[-1]
        text += "".join(f" ({hint})" for name, hint in _HINTS if name in path)
    return ValidationError(_code_of(exc), f"{op}: {text}")


def _check_int(v: Any, lo: int, hi: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValidationError(ErrorCode.BAD_FIELD, "expected an integer")
    if not lo <= v <= hi:
        raise ValidationError(ErrorCode.OUT_OF_RANGE, f"{v} not in [{lo}, {hi}]")
    return v


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack_header(frame: bytes) -> dict[str, Any]:
    """Decode a header frame into a map; raises ValidationError(BAD_FRAME/TOO_LARGE)."""
    if len(frame) > MAX_HEADER_BYTES:
        raise ValidationError(ErrorCode.TOO_LARGE, f"header frame over {MAX_HEADER_BYTES} bytes")
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many kinds; all mean "not a valid frame"
        raise ValidationError(ErrorCode.BAD_FRAME, f"undecodable msgpack: {type(exc).__name__}") from exc
    if not isinstance(obj, dict):
        raise ValidationError(ErrorCode.BAD_FRAME, "message must be a msgpack map")
    return obj


def request_id_of(msg: dict[str, Any]) -> int:
    """The request id if usable, else 0 (so even a broken request gets a correlated reply)."""
    rid = msg.get("id")
    return rid if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid <= MAX_ID else 0


def check_envelope(msg: dict[str, Any]) -> type[Request]:
    """The envelope of a decoded map: version, id, op and auth; returns the op's Struct."""
    if "v" not in msg:
        raise ValidationError(ErrorCode.BAD_VERSION, "missing protocol version 'v'")
    if msg["v"] != PROTOCOL_VERSION or isinstance(msg["v"], bool):
        raise ValidationError(
            ErrorCode.BAD_VERSION, f"protocol version {msg['v']!r} not supported (server speaks {PROTOCOL_VERSION})"
        )
    _check_int(msg.get("id"), 0, MAX_ID)
    op = msg.get("op")
    if not isinstance(op, str) or op not in SCHEMA:
        raise ValidationError(ErrorCode.UNKNOWN_OP, f"unknown op {str(op)[:40]!r}")
    auth = msg.get("auth")
    if auth is not None and (not isinstance(auth, str) or len(auth) > 1024):
        raise ValidationError(ErrorCode.BAD_FIELD, "auth must be a string of at most 1024 chars")
    return SCHEMA[op]


def validate_request(msg: dict[str, object]) -> tuple[int, str, Request]:
    """Check a decoded map (envelope, then fields); returns (id, op, the typed request)."""
    cls = check_envelope(msg)
    op = cls.__struct_config__.tag
    try:
        req = msgspec.convert(msg, cls, strict=True)
    except msgspec.ValidationError as exc:
        raise coded(exc, str(op)) from None
    except ValidationError as exc:
        raise ValidationError(exc.code, f"{op}: {exc.message}") from None
    return req.id, str(op), req


def decode_request(frame: bytes) -> tuple[int, Request]:
    """One header frame -> (id, typed request); raises ValidationError carrying the request id if readable.

    The error's `rid` attribute is the id to answer with (0 when the frame is unreadable).
    """
    if len(frame) > MAX_HEADER_BYTES:
        raise ValidationError(ErrorCode.TOO_LARGE, f"header frame over {MAX_HEADER_BYTES} bytes")
    try:
        req: Request = _DECODER.decode(frame)
        if req.v == PROTOCOL_VERSION:
            return req.id, req
    except (msgspec.DecodeError, ValidationError, RecursionError):
        pass  # say exactly what is wrong below
    msg = unpack_header(frame)
    try:
        rid, _op, req = validate_request(msg)
    except ValidationError as exc:
        exc.rid = request_id_of(msg)
        raise
    return rid, req
