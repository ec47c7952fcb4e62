"""The closed message schema: every op's request fields, typed and bounded, checked on decode.

Requests are msgpack maps `{"v", "id", "op", ...fields}`; replies are `{"id", "ok", "result"}` or
`{"id", "ok": False, "error": {"code", "message"}}`. Data for tcp mode rides as extra ZMQ frames.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from ._ec_messages import EC_OPS
from ._errors import ErrorCode, ValidationError
from ._hashing import check_extra
from ._keys import MAX_GROUPS, MAX_WORLD_SIZE, validate_fingerprint, validate_model, validate_salt
from ._layout import LayoutDescriptor

PROTOCOL_VERSION = 1
MAX_TOKENS = 1 << 20  # tokens in one request (4 MiB packed)
MAX_HEADER_BYTES = 4 * MAX_TOKENS + (64 << 10)  # the msgpack header: MAX_TOKENS plus the other fields
MAX_CHUNKS = 1 << 14
MAX_ID = (1 << 63) - 1
MAX_KEYS = 1 << 16  # objects one request may name (chunks x world_size x groups): bounds its work
MODES = ("shm", "tcp")


@dataclass(frozen=True, slots=True)
class Field:
    check: Callable[[Any], Any]
    required: bool = True


def _int(lo: int, hi: int) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValidationError(ErrorCode.BAD_FIELD, "expected an integer")
        if not lo <= v <= hi:
            raise ValidationError(ErrorCode.OUT_OF_RANGE, f"{v} not in [{lo}, {hi}]")
        return v

    return check


def _str(max_len: int, choices: tuple[str, ...] = ()) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if not isinstance(v, str) or not 1 <= len(v) <= max_len:
            raise ValidationError(ErrorCode.BAD_FIELD, f"expected a string of 1-{max_len} chars")
        if choices and v not in choices:
            raise ValidationError(ErrorCode.BAD_FIELD, f"expected one of {list(choices)}")
        return v

    return check


def _tokens(v: Any) -> bytes:
    if not isinstance(v, bytes):
        raise ValidationError(ErrorCode.BAD_FIELD, "tokens must be packed uint32 bytes")
    if len(v) % 4:
        raise ValidationError(ErrorCode.BAD_FIELD, "tokens length must be a multiple of 4")
    if len(v) // 4 > MAX_TOKENS:
        raise ValidationError(ErrorCode.TOO_LARGE, f"more than {MAX_TOKENS} tokens")
    return v


def _extra(v: Any) -> list[tuple[int, bytes]]:
    """Per-chunk extra keys: [[chunk index, 32-byte digest], ...], indices strictly increasing.

    Whether every index names a full chunk of the request depends on the server's chunk size: the
    server checks that (OUT_OF_RANGE) before it changes anything.
    """
    if not isinstance(v, list) or len(v) > MAX_CHUNKS:
        raise ValidationError(ErrorCode.BAD_FIELD, f"extra must be a list of at most {MAX_CHUNKS} pairs")
    for item in v:
        if isinstance(item, list) and len(item) == 2:
            _int(0, MAX_CHUNKS)(item[0])
    try:
        return check_extra(tuple(item) if isinstance(item, list) else item for item in v)
    except ValueError as exc:
        raise ValidationError(ErrorCode.BAD_FIELD, str(exc)) from None


def _keyspace(v: Any) -> dict[str, Any]:
    if not isinstance(v, dict) or set(v) - {"model", "world_size", "groups"}:
        raise ValidationError(ErrorCode.BAD_FIELD, "keyspace must be a map of model, world_size, groups")
    if "model" not in v or "world_size" not in v or "groups" not in v:
        raise ValidationError(ErrorCode.BAD_FIELD, "keyspace needs model, world_size and groups")
    groups = v["groups"]
    if not isinstance(groups, list) or not 1 <= len(groups) <= MAX_GROUPS:
        raise ValidationError(ErrorCode.BAD_FIELD, f"groups must be a list of 1-{MAX_GROUPS} fingerprints")
    world = _int(1, MAX_WORLD_SIZE)(v["world_size"])
    if world * len(groups) > MAX_KEYS:
        raise ValidationError(ErrorCode.TOO_LARGE, f"world_size x groups over {MAX_KEYS} objects per chunk")
    return {
        "model": validate_model(v["model"]),
        "world_size": world,
        "groups": [validate_fingerprint(g) for g in groups],
    }


MAX_CHECKSUMS = MAX_CHUNKS * MAX_GROUPS
U64_MAX = (1 << 64) - 1


def _checksums(v: Any) -> list[int]:
    """One kvsum64 (uint64) per reserved slot of a store, in slot order: the proof of the write."""
    if not isinstance(v, list) or len(v) > MAX_CHECKSUMS:
        raise ValidationError(ErrorCode.BAD_FIELD, f"checksums must be a list of at most {MAX_CHECKSUMS} uint64")
    for x in v:
        if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x <= U64_MAX:
            raise ValidationError(ErrorCode.BAD_FIELD, "checksums must be unsigned 64-bit integers")
    return v


def _layouts(v: Any) -> list[LayoutDescriptor]:
    if not isinstance(v, list) or not 1 <= len(v) <= MAX_GROUPS:
        raise ValidationError(ErrorCode.BAD_FIELD, f"groups must be a list of 1-{MAX_GROUPS} layouts")
    return [LayoutDescriptor.from_wire(item) for item in v]


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValidationError(ErrorCode.BAD_FIELD, "must be true or false")
    return v


_SESSION = _str(128)
_OPT = False

SCHEMA: dict[str, dict[str, Field]] = {
    "ping": {},
    "describe": {},
    "clear": {},
    "register_engine": {
        "model": Field(validate_model),
        "world_size": Field(_int(1, MAX_WORLD_SIZE)),
        "rank": Field(_int(0, MAX_WORLD_SIZE - 1)),
        "groups": Field(_layouts),
        "host": Field(_str(255), _OPT),
        "pid": Field(_int(0, 1 << 31), _OPT),
    },
    "lookup": {
        "keyspace": Field(_keyspace),
        "tokens": Field(_tokens),
        "extra": Field(_extra, _OPT),
        "salt": Field(validate_salt, _OPT),
        "session": Field(_SESSION, _OPT),
        "rank": Field(_int(0, MAX_WORLD_SIZE - 1), _OPT),  # with session: lease only this rank's objects
        "wait": Field(_bool, _OPT),  # false: do not wait for an L2 prefetch; the reply says "pending"
    },
    "query": {
        "keyspace": Field(_keyspace),
        "tokens": Field(_tokens),
        "extra": Field(_extra, _OPT),
        "salt": Field(validate_salt, _OPT),
    },
    "store": {
        "keyspace": Field(_keyspace),
        "tokens": Field(_tokens),
        "extra": Field(_extra, _OPT),
        "rank": Field(_int(0, MAX_WORLD_SIZE - 1)),
        "salt": Field(validate_salt, _OPT),
        "start_chunk": Field(_int(0, MAX_CHUNKS), _OPT),
        "mode": Field(_str(8, MODES), _OPT),
        "session": Field(_SESSION, _OPT),
    },
    "commit": {"store_id": Field(_str(64)), "checksums": Field(_checksums)},
    "abort": {"store_id": Field(_str(64))},
    "retrieve": {
        "session": Field(_SESSION),
        "rank": Field(_int(0, MAX_WORLD_SIZE - 1)),
        "start_chunk": Field(_int(0, MAX_CHUNKS)),
        "end_chunk": Field(_int(0, MAX_CHUNKS)),
        "mode": Field(_str(8, MODES), _OPT),
    },
    "release": {  # without rank: the whole session; with rank (+ lease from retrieve): that reader only
        "session": Field(_SESSION),
        "rank": Field(_int(0, MAX_WORLD_SIZE - 1), _OPT),
        "lease": Field(_int(1, MAX_ID), _OPT),
    },
    "end_session": {"session": Field(_SESSION)},
    "pin": {"keyspace": Field(_keyspace), "tokens": Field(_tokens), "extra": Field(_extra, _OPT),
            "salt": Field(validate_salt, _OPT)},
    "unpin": {"keyspace": Field(_keyspace), "tokens": Field(_tokens), "extra": Field(_extra, _OPT),
              "salt": Field(validate_salt, _OPT)},
}
SCHEMA.update({op: {name: Field(check, req) for name, (check, req) in spec.items()} for op, spec in EC_OPS.items()})


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


def validate_request(msg: dict[str, Any]) -> tuple[int, str, dict[str, Any]]:
    """Check envelope and fields; returns (id, op, fields) with fields converted by their checks."""
    if "v" not in msg:
        raise ValidationError(ErrorCode.BAD_VERSION, "missing protocol version 'v'")
    if msg["v"] != PROTOCOL_VERSION or isinstance(msg["v"], bool):
        raise ValidationError(
            ErrorCode.BAD_VERSION, f"protocol version {msg['v']!r} not supported (server speaks {PROTOCOL_VERSION})"
        )
    rid = msg.get("id")
    _int(0, MAX_ID)(rid)
    op = msg.get("op")
    if not isinstance(op, str) or op not in SCHEMA:
        raise ValidationError(ErrorCode.UNKNOWN_OP, f"unknown op {str(op)[:40]!r}")
    spec = SCHEMA[op]
    auth = msg.get("auth")
    if auth is not None and (not isinstance(auth, str) or len(auth) > 1024):
        raise ValidationError(ErrorCode.BAD_FIELD, "auth must be a string of at most 1024 chars")
    extra = set(msg) - set(spec) - {"v", "id", "op", "auth"}
    if extra:
        raise ValidationError(ErrorCode.BAD_FIELD, f"unexpected fields for {op}: {sorted(map(str, extra))[:8]}")
    fields: dict[str, Any] = {}
    for name, field in spec.items():
        if name not in msg:
            if field.required:
                raise ValidationError(ErrorCode.BAD_FIELD, f"{op}: missing field {name!r}")
            continue
        try:
            fields[name] = field.check(msg[name])
        except ValidationError as exc:
            raise ValidationError(exc.code, f"{op}.{name}: {exc.message}") from None
    return rid, op, fields


def ok_reply(rid: int, result: Any) -> dict[str, Any]:
    return {"id": rid, "ok": True, "result": result}


def error_reply(rid: int, code: ErrorCode | str, message: str) -> dict[str, Any]:
    return {"id": rid, "ok": False, "error": {"code": str(code), "message": message}}
