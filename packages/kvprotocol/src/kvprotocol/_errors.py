"""Error codes shared by server and clients, and the exceptions clients raise.

Every client-side failure is a KVProtocolError (kvconnector's engine errors too); each class says what
it is in `kind`, the short name engines put in their results and warnings, and keeps its fields (a
server error its `code` and `message`) instead of flattening them into a string. The server's own
error tree is kvserver.errors; both meet only in the wire reply's code.
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar


class ErrorCode(StrEnum):
    """Every error reply carries exactly one of these codes."""

    BAD_FRAME = "BAD_FRAME"  # not decodable msgpack, or not a map
    BAD_VERSION = "BAD_VERSION"  # protocol version mismatch
    UNKNOWN_OP = "UNKNOWN_OP"
    BAD_FIELD = "BAD_FIELD"  # missing, unexpected or mistyped field
    OUT_OF_RANGE = "OUT_OF_RANGE"  # ids, offsets, sizes, counts outside their bounds
    TOO_LARGE = "TOO_LARGE"  # frame, token array, objects per request or block_shape over its bound
    TOO_MANY = "TOO_MANY"  # sessions or stores in flight at their cap; end some and retry
    UNKNOWN_ENGINE = "UNKNOWN_ENGINE"
    UNKNOWN_SESSION = "UNKNOWN_SESSION"
    UNKNOWN_STORE = "UNKNOWN_STORE"
    NOT_LEASED = "NOT_LEASED"  # retrieve of objects the session holds no lease on
    NO_SPACE = "NO_SPACE"  # L1 full and nothing evictable
    RETRY_LATER = "RETRY_LATER"  # a whole-request reservation does not fit now; retry after others complete
    LAYOUT_MISMATCH = "LAYOUT_MISMATCH"
    UNAUTHORIZED = "UNAUTHORIZED"
    FORBIDDEN = "FORBIDDEN"  # an admin op (clear, full describe) sent with a tenant's token
    INTERNAL = "INTERNAL"  # a handler failed; the server keeps serving


class KVProtocolError(Exception):
    """Base of every error this package raises (a reply that cannot be decoded, among others)."""

    KIND: ClassVar[str] = "internal"

    @property
    def kind(self) -> str:
        """The failure's short name ("timeout", "server:NO_SPACE", ...), for results and warnings."""
        return self.KIND


class ServerError(KVProtocolError):
    """The server answered with an error reply."""

    def __init__(self, code: ErrorCode | str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = ErrorCode(code) if code in ErrorCode.__members__ else code
        self.message = message

    @property
    def kind(self) -> str:  # per instance: the code is part of it
        return f"server:{self.code}"


class RequestTimeout(KVProtocolError):
    """No reply arrived within the request's timeout (the server may be down)."""

    KIND = "timeout"


class ValidationError(KVProtocolError):
    """A message or value failed validation; `code` says which kind."""

    KIND = "invalid"

    def __init__(self, code: ErrorCode, message: str, rid: int = 0) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.rid = rid  # the id of the request it answers, where readable (0 otherwise)
