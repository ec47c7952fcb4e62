"""The encoder cache's journal: what a restarted server needs to re-adopt the ready EC objects.

The same append-only file as L1's (l1/journal.py: COMMIT when an object becomes ready, FREE before
its slot is freed, CRC per record, torn last record ignored, header naming the segment's file and
capacity), under its own magic and with EC's own COMMIT body: the key, the offset, the size, the
kvsum64 and the tensor's dtype and shape, which lookups hand back with each hit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import msgpack

from ..l1.journal import COMMIT, ArenaJournal, _record, journal_path, read_records

__all__ = ["EC_MAGIC", "ECCommitted", "ec_journal", "read_ec_journal"]

EC_MAGIC = b"KVSECJR\0"
MAX_FIELD = 1024  # characters of one key field: more than any model, space or item name the protocol allows
_DTYPE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")

ECKey = tuple[str, str, str, str]


@dataclass(slots=True, frozen=True)
class ECCommitted:
    """One ready encoder output as the journal last recorded it."""

    key: ECKey
    offset: int
    size: int
    checksum: int
    dtype: str
    shape: tuple[int, ...]


def _encode(c: ECCommitted) -> bytes:
    body = [c.offset, c.size, c.checksum, list(c.key), c.dtype, list(c.shape)]
    return _record(COMMIT, msgpack.packb(body, use_bin_type=True))


def _decode(kind: int, body: bytes) -> tuple[int, ECCommitted | None] | None:
    """(offset, object) of a COMMIT body; None for a body that is not one (replay stops)."""
    if kind != COMMIT:
        return None
    try:
        offset, size, checksum, key, dtype, shape = msgpack.unpackb(body, raw=False)
    except Exception:
        return None
    if not (isinstance(offset, int) and offset >= 0):
        return None
    fields_ok = isinstance(key, list) and len(key) == 4 and all(isinstance(k, str) and len(k) <= MAX_FIELD for k in key)
    shape_ok = isinstance(shape, list) and 1 <= len(shape) <= 8 and all(isinstance(d, int) and d >= 0 for d in shape)
    sizes_ok = isinstance(size, int) and size > 0 and isinstance(checksum, int) and 0 <= checksum < 1 << 64
    if not (fields_ok and shape_ok and sizes_ok and isinstance(dtype, str) and _DTYPE.match(dtype)):
        return offset, None
    return offset, ECCommitted((key[0], key[1], key[2], key[3]), offset, size, checksum, dtype, tuple(shape))


def ec_journal(arena_path: Path, identity: tuple[int, int], capacity: int) -> ArenaJournal[ECCommitted]:
    return ArenaJournal(journal_path(arena_path), identity, capacity, EC_MAGIC, _encode)


def read_ec_journal(arena_path: Path, identity: tuple[int, int], capacity: int) -> tuple[list[ECCommitted], str]:
    return read_records(journal_path(arena_path), identity, capacity, EC_MAGIC, _decode)
