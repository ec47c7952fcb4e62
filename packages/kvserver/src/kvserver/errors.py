"""The server's error tree: every failure a handler reports to its client, each class with its wire code.

Why a tree of our own: handlers raise what went wrong in the server's terms (`NoSpace`, `UnknownStore`),
not kvprotocol's `ValidationError`, which stays what it says: a message that failed the protocol's
checks. Both become the same `{"code", "message"}` error reply at exactly one place per door:
`wire_error` below, called by server.py (ZMQ) and http/errors.py (HTTP, which adds the status).

    KVServerError
    ├── InvalidRequest        a well-formed request this server cannot take
    │   ├── BadField            BAD_FIELD
    │   ├── OutOfRange          OUT_OF_RANGE
    │   ├── TooLarge            TOO_LARGE
    │   └── LayoutMismatch      LAYOUT_MISMATCH
    ├── UnknownId             a handle that names nothing (never issued, expired, another tenant's)
    │   ├── UnknownSession      UNKNOWN_SESSION
    │   └── UnknownStore        UNKNOWN_STORE
    ├── NotLeased             NOT_LEASED
    ├── OutOfCapacity         full now; a later try may succeed
    │   ├── NoSpace             NO_SPACE
    │   ├── TooMany             TOO_MANY
    │   └── RetryLater          RETRY_LATER
    └── AccessDenied
        ├── Unauthorized        UNAUTHORIZED
        └── Forbidden           FORBIDDEN
"""

from __future__ import annotations

from typing import ClassVar

from kvprotocol import ErrorCode, ValidationError

MAX_INTERNAL_MESSAGE = 500  # an unexpected exception's text in an INTERNAL reply, at most


class KVServerError(Exception):
    """Base of every failure a handler answers with an error reply; `code` is the reply's wire code."""

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class InvalidRequest(KVServerError):
    """A request that passed the protocol's checks but not this server's (its state, its limits)."""

    code = ErrorCode.BAD_FIELD


class BadField(InvalidRequest):
    code = ErrorCode.BAD_FIELD


class OutOfRange(InvalidRequest):
    code = ErrorCode.OUT_OF_RANGE


class TooLarge(InvalidRequest):
    code = ErrorCode.TOO_LARGE


class LayoutMismatch(InvalidRequest):
    """A layout no engine registered (a restarted server forgot it: the engine registers again)."""

    code = ErrorCode.LAYOUT_MISMATCH


class UnknownId(KVServerError):
    """A handle that names nothing: never issued, expired, or another tenant's (indistinguishable on purpose)."""


class UnknownSession(UnknownId):
    code = ErrorCode.UNKNOWN_SESSION


class UnknownStore(UnknownId):
    code = ErrorCode.UNKNOWN_STORE


class NotLeased(KVServerError):
    """A retrieve of objects the session holds no lease on."""

    code = ErrorCode.NOT_LEASED


class OutOfCapacity(KVServerError):
    """The server is full of something right now: the request may succeed later."""


class NoSpace(OutOfCapacity):
    """L1 (or a tenant's quota) has no room and nothing is evictable."""

    code = ErrorCode.NO_SPACE


class TooMany(OutOfCapacity):
    """Sessions, stores or leases in flight at their cap: end some and retry."""

    code = ErrorCode.TOO_MANY


class RetryLater(OutOfCapacity):
    """A whole-request reservation does not fit next to the others now."""

    code = ErrorCode.RETRY_LATER


class AccessDenied(KVServerError):
    code = ErrorCode.FORBIDDEN


class Unauthorized(AccessDenied):
    code = ErrorCode.UNAUTHORIZED


class Forbidden(AccessDenied):
    """An admin op sent with a tenant's token."""

    code = ErrorCode.FORBIDDEN


def wire_error(exc: BaseException) -> tuple[ErrorCode, str] | None:
    """The (code, message) of an error reply for an expected failure; None for a bug (answered INTERNAL).

    Expected are the server's own errors and kvprotocol's ValidationError (a request that failed
    decoding or the protocol's checks, with the code the decoder chose).
    """
    if isinstance(exc, KVServerError | ValidationError):
        return exc.code, exc.message
    return None


def internal_error(exc: BaseException) -> tuple[ErrorCode, str]:
    """The reply to a failure nobody expected: INTERNAL with the exception's type and (capped) text."""
    return ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"[:MAX_INTERNAL_MESSAGE]
