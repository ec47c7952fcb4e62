"""JSON bodies of the admin API's key endpoints, decoded by kvprotocol's typed definitions.

`KeysBody` (kvprotocol) checks the JSON shape, then becomes the op's request Struct, so the values are
checked by the same definition as a ZMQ request: both doors accept exactly the same things.
"""

from __future__ import annotations

import msgspec

from kvprotocol import MAX_TOKENS, ErrorCode, ValidationError
from kvprotocol._messages import coded
from kvprotocol._requests import KeysBody, KeysRequest

from .errors import ApiError


def decode_keys(raw: bytes, cls: type[KeysRequest]) -> KeysRequest:
    """The request Struct of a key endpoint's body; ApiError (400 BAD_JSON) or ValidationError."""
    op = str(cls.__struct_config__.tag)
    try:
        parsed = msgspec.json.decode(raw)  # first: is it JSON at all (else a type error would hide that)
    except msgspec.DecodeError:
        raise ApiError(400, "BAD_JSON", "request body is not valid JSON") from None
    except RecursionError:  # msgspec's depth guard: thousands of nested arrays
        raise ApiError(400, "BAD_JSON", "request body is nested too deeply") from None
    try:
        body = msgspec.convert(parsed, KeysBody, strict=True)
    except msgspec.ValidationError as exc:
        text = str(exc)
        if "$.tokens" in text:  # token ids are checked here, the way the wire form cannot
            if text.startswith("Expected `array` of length <="):
                raise ValidationError(ErrorCode.TOO_LARGE, f"more than {MAX_TOKENS} tokens") from None
            raise ValidationError(ErrorCode.BAD_FIELD, f"{op}: {text} (token ids are uint32)") from None
        raise coded(exc, op) from None
    try:
        return body.request(cls)
    except msgspec.ValidationError as exc:
        raise coded(exc, op) from None
