"""ObjectKey: the identity of one cached chunk object, and the validation of its parts."""

from __future__ import annotations

import re
from typing import NamedTuple

from blake3 import blake3

from ._errors import ErrorCode, ValidationError

_MODEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,199}$")
_SALT_RE = re.compile(r"^[A-Za-z0-9._:@+=/-]{0,128}$")
_FP_RE = re.compile(r"^[0-9a-f]{16}$")
# a salt inside a key: the server may put it in a tenant's namespace, `~tenant~salt` ("~" is not in
# a client's salt, so no client can spell another tenant's prefix)
_KEY_SALT_RE = re.compile(r"^(~[a-z][a-z0-9_-]{0,31}~)?[A-Za-z0-9._:@+=/-]{0,128}$")
MAX_WORLD_SIZE = 4096
MAX_GROUPS = 64
SHARED_RANK = -1  # kv_rank of an object all ranks share (an MLA latent cache is the same on every rank)


def validate_model(model: object) -> str:
    if not isinstance(model, str) or not _MODEL_RE.match(model):
        raise ValidationError(ErrorCode.BAD_FIELD, "model name must be 1-200 chars of [A-Za-z0-9._/:@+-]")
    return model


def validate_salt(salt: object) -> str:
    if not isinstance(salt, str) or not _SALT_RE.match(salt):
        raise ValidationError(ErrorCode.BAD_FIELD, "cache salt must be 0-128 chars of [A-Za-z0-9._:@+=/-]")
    return salt


def validate_fingerprint(fp: object) -> str:
    if not isinstance(fp, str) or not _FP_RE.match(fp):
        raise ValidationError(ErrorCode.BAD_FIELD, "layout fingerprint must be 16 lowercase hex chars")
    return fp


class ObjectKey(NamedTuple):
    """(model, layout, world size, rank, group, salt, chunk hash): what one object holds.

    The request id is never part of it: requests end, cached objects stay. A NamedTuple because the
    server hashes these in its hottest loop (a lookup probes every object of every chunk): it hashes
    and compares as a plain tuple, and making one checks nothing (the server builds keys from parts
    the wire schema already checked; a key built from anything else goes through `validate`). The
    server's per-chunk builders make it as `tuple.__new__(ObjectKey, parts)`: the same object, built
    in C, without the Python frame of the generated `__new__`.
    """

    model: str
    layout_fingerprint: str
    world_size: int
    kv_rank: int
    group: int
    salt: str
    chunk_hash: bytes

    def validate(self) -> ObjectKey:
        """The key itself, or ValidationError naming the first part out of range."""
        validate_model(self.model)
        validate_fingerprint(self.layout_fingerprint)
        if not isinstance(self.salt, str) or not _KEY_SALT_RE.match(self.salt):
            raise ValidationError(ErrorCode.BAD_FIELD, "bad salt in an object key")
        if not (
            1 <= self.world_size <= MAX_WORLD_SIZE
            and (0 <= self.kv_rank < self.world_size or self.kv_rank == SHARED_RANK)
        ):
            raise ValidationError(ErrorCode.OUT_OF_RANGE, "world_size/kv_rank out of range")
        if not 0 <= self.group < MAX_GROUPS:
            raise ValidationError(ErrorCode.OUT_OF_RANGE, "object group out of range")
        if len(self.chunk_hash) != 32:
            raise ValidationError(ErrorCode.BAD_FIELD, "chunk hash must be 32 bytes")
        return self

    def to_str(self) -> str:
        """Stable string form, used as the L2 key. The salt is hashed so it never appears raw."""
        salt = blake3(self.salt.encode()).hexdigest()[:16] if self.salt else "-"
        return (
            f"kv1/{self.model}/{self.layout_fingerprint}/w{self.world_size}"
            f"r{'s' if self.kv_rank == SHARED_RANK else self.kv_rank}"
            f"/g{self.group}/{salt}/{self.chunk_hash.hex()}"
        )

    def fingerprint(self) -> bytes:
        """16-byte digest of the whole key; L2 integrity headers carry it."""
        return blake3(self.to_str().encode()).digest()[:16]
