"""Encoder-cache (EC) ops: their request fields, typed and bounded (docs/protocol.md, "Encoder cache").

Why a module of its own: EC objects (one encoder output per multimodal item) live in their own
namespace with their own budget, and their messages share nothing with the token-chunk KV ops but
the envelope. `_messages.SCHEMA` takes these entries as (check, required) pairs, so this module
needs nothing from it.

Identity of an EC object: (model, space, item). `space` is a 16-hex fingerprint of what makes the
encoder output (model weights, model dtype), with world size and rank folded to sentinels: every
TP rank computes the same encoder output, so it is stored once. `item` is the engine's multimodal
identifier (vLLM's `mm_hash`), a content hash of the image.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ._errors import ErrorCode, ValidationError
from ._keys import MAX_WORLD_SIZE, validate_fingerprint, validate_model

MAX_EC_ITEMS = 256  # items one ec_lookup may name
MAX_EC_DIMS = 8
MAX_EC_BYTES = 1 << 34  # one encoder output (the server's EC budget bounds it further)
U64_MAX = (1 << 64) - 1
_ITEM_RE = re.compile(r"^[A-Za-z0-9._:@+=/-]{1,256}$")
_DTYPE_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
EC_MODES = ("shm", "tcp")


def validate_item(v: Any) -> str:
    if not isinstance(v, str) or not _ITEM_RE.match(v):
        raise ValidationError(ErrorCode.BAD_FIELD, "item must be 1-256 chars of [A-Za-z0-9._:@+=/-]")
    return v


def _items(v: Any) -> list[str]:
    if not isinstance(v, list) or not 1 <= len(v) <= MAX_EC_ITEMS:
        raise ValidationError(ErrorCode.BAD_FIELD, f"items must be a list of 1-{MAX_EC_ITEMS} identifiers")
    return [validate_item(x) for x in v]


def _uint(hi: int) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValidationError(ErrorCode.BAD_FIELD, "expected an integer")
        if not 0 <= v <= hi:
            raise ValidationError(ErrorCode.OUT_OF_RANGE, f"{v} not in [0, {hi}]")
        return v

    return check


def _dtype(v: Any) -> str:
    if not isinstance(v, str) or not _DTYPE_RE.match(v):
        raise ValidationError(ErrorCode.BAD_FIELD, "dtype must be a short lowercase name such as 'float32'")
    return v


def _shape(v: Any) -> list[int]:
    if not isinstance(v, list) or not 1 <= len(v) <= MAX_EC_DIMS:
        raise ValidationError(ErrorCode.BAD_FIELD, f"shape must be a list of 1-{MAX_EC_DIMS} sizes")
    return [_uint(MAX_EC_BYTES)(d) for d in v]


def _mode(v: Any) -> str:
    if v not in EC_MODES:
        raise ValidationError(ErrorCode.BAD_FIELD, f"mode must be one of {list(EC_MODES)}")
    return str(v)


def _store_id(v: Any) -> str:
    if not isinstance(v, str) or not 1 <= len(v) <= 64:
        raise ValidationError(ErrorCode.BAD_FIELD, "store_id must be a string of 1-64 chars")
    return v


def _lease_id(v: Any) -> str:
    if not isinstance(v, str) or not re.match(r"^[A-Za-z0-9_-]{1,64}$", v):
        raise ValidationError(ErrorCode.BAD_FIELD, "lease must be the string ec_lookup / ec_retrieve handed out")
    return v


_REQ, _OPT = True, False
_KEY = {"model": (validate_model, _REQ), "space": (validate_fingerprint, _REQ)}

# op -> field -> (check, required)
EC_OPS: dict[str, dict[str, tuple[Callable[[Any], Any], bool]]] = {
    # Which items are ready; with readers > 0 each hit is also leased for that many release calls
    # (one per TP rank that will read it) or until the lease TTL ends.
    "ec_lookup": {**_KEY, "items": (_items, _REQ), "readers": (_uint(MAX_WORLD_SIZE), _OPT)},
    "ec_store": {
        **_KEY,
        "item": (validate_item, _REQ),
        "dtype": (_dtype, _REQ),
        "shape": (_shape, _REQ),
        "size": (_uint(MAX_EC_BYTES), _REQ),
        "mode": (_mode, _OPT),
    },
    "ec_commit": {"store_id": (_store_id, _REQ), "checksum": (_uint(U64_MAX), _REQ)},
    "ec_abort": {"store_id": (_store_id, _REQ)},
    "ec_retrieve": {**_KEY, "item": (validate_item, _REQ), "mode": (_mode, _OPT)},
    "ec_release": {"lease": (_lease_id, _REQ)},
    "ec_clear": {},
}
EC_DATA_OPS = frozenset({"ec_commit"})  # tcp mode: the object's bytes ride as one extra frame
