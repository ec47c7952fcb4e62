"""The reply frame around a result: `{"id", "ok": true, "result"}` or `{"id", "ok": false, "error"}`.

The server encodes these Structs with the reply Struct (kvprotocol._replies) inside, in one pass. A
client reads the envelope first (it needs the id to know whose reply it is, and so which Struct the
result is) and leaves the result as raw msgpack (`msgspec.Raw`), which it then decodes once, straight
into the reply Struct of the request it sent: no intermediate map.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ._errors import ErrorCode, KVProtocolError
from ._requests import MAX_HEADER_BYTES


class ErrorBody(msgspec.Struct):
    code: str
    message: str


class OkEnvelope(msgspec.Struct):
    id: int
    ok: bool  # always True
    result: Any  # a kvprotocol._replies Struct


class ErrorEnvelope(msgspec.Struct):
    id: int
    ok: bool  # always False
    error: ErrorBody


_ENCODER = msgspec.msgpack.Encoder()


def ok_reply(rid: int, result: Any) -> OkEnvelope:
    return OkEnvelope(rid, True, result)


def error_reply(rid: int, code: ErrorCode | str, message: str) -> ErrorEnvelope:
    return ErrorEnvelope(rid, False, ErrorBody(str(code), message))


def encode_reply(reply: OkEnvelope | ErrorEnvelope) -> bytes:
    """The reply's header frame."""
    return _ENCODER.encode(reply)


_NIL = msgspec.Raw(b"\xc0")  # msgpack nil: a reply without a result


class ReplyHead(msgspec.Struct):
    """A reply frame as a client first reads it. Lenient: a malformed reply is still matched by id
    where it has one, and then fails as a protocol error, not a decode error of the whole frame."""

    id: Any = None
    ok: Any = None
    result: msgspec.Raw = _NIL
    error: Any = None

    @property
    def rid(self) -> int:
        """The id, or -1 (nobody's) when it is missing or not an integer."""
        return self.id if isinstance(self.id, int) else -1


_HEAD = msgspec.msgpack.Decoder(ReplyHead)


def decode_head(frame: bytes) -> ReplyHead:
    """A reply's header frame, the result left raw; raises KVProtocolError when it is not a reply map."""
    if len(frame) > MAX_HEADER_BYTES:
        raise KVProtocolError(f"undecodable reply from server: header frame over {MAX_HEADER_BYTES} bytes")
    try:
        return _HEAD.decode(frame)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise KVProtocolError(f"undecodable reply from server: {exc}") from exc
