"""The arena journal: what a restarted server needs to re-adopt the committed objects of its arena.

Why a journal beside the arena and not a header in each slot: engines map the whole arena read-write,
so anything inside it can be rewritten by any shm engine; a slot header forged there could claim
another tenant's key for bytes of the forger's choosing (the checksum is not a MAC). The journal is
a file of its own under /dev/shm (`<arena>.journal`, 0600) that only the server opens. Per-slot
headers would also cost a page per object and change the offsets engines are handed.

It is append-only: a COMMIT record when an object becomes ready (key, offset, size, kvsum64, the
chunk it extends; a TAIL record for a tail, which adds its length in tokens and its key space's
layouts, so a restarted server can find it again: service/tails.py) and a FREE record before a ready
object's slot is freed (eviction, clear, removal), so at any moment the replayed records name exactly
the ready objects. Each record carries a CRC32;
a `kill -9` in the middle of an append leaves a torn last record, which replay ignores. Objects
being written, reserved or quarantined have no record: a crash forgets them and their slots are free
again. When records pile up (evictions) the journal is rewritten from the index (`compact`) and
renamed over the old one, atomically. The header names the arena file (device, inode), its capacity
and the format version, so a journal is never applied to some other arena.
"""

from __future__ import annotations

import logging
import os
import stat
import struct
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import msgpack

from kvprotocol import ObjectKey

log = logging.getLogger("kvserver.arena")

__all__ = ["FORMAT", "ArenaJournal", "Committed", "TailMark", "read_journal", "read_records"]

T = TypeVar("T")

FORMAT = 2  # what this server writes; bump when records change (2: TAIL records)
READS = (1, 2)  # the formats it replays; a journal of any other is not adopted (nor is 2 by a server reading 1)
MAGIC = b"KVSJRNL\0"
HEADER = struct.Struct("<8sIQQQ")  # magic, format, arena device, arena inode, capacity
RECORD = struct.Struct("<IB")  # body length (kind byte included in the CRC), kind
COMMIT, FREE, TAIL = 1, 2, 3
COMMIT_FIXED = struct.Struct("<QQQB")  # offset, size, kvsum64, parent hash length
TAIL_FIXED = struct.Struct("<HH")  # tail length in tokens, length of the packed layouts; then a COMMIT body
FREE_FIXED = struct.Struct("<Q")
MAX_RECORD = 1 << 16
COMPACT_MIN = 4096  # records: below this the journal is never rewritten


@dataclass(slots=True, frozen=True)
class Committed:
    """One ready object as the journal last recorded it."""

    key: ObjectKey
    offset: int
    size: int
    checksum: int
    parent: bytes | None
    tail: TailMark | None = None


@dataclass(slots=True, frozen=True)
class TailMark:
    """What makes an object a tail: its length in tokens (under a chunk) and the layout fingerprints
    of its key space, every group (service/tails.py keys its index by the key space)."""

    length: int
    groups: tuple[str, ...]


def journal_path(arena_path: Path) -> Path:
    return arena_path.with_name(arena_path.name + ".journal")


def _encode_key(key: ObjectKey) -> bytes:
    return msgpack.packb(list(key), use_bin_type=True)


def _decode_key(raw: bytes) -> ObjectKey | None:
    try:
        parts = msgpack.unpackb(raw, raw=False)
        key = ObjectKey(*parts)
        return key.validate()
    except Exception:  # a record that does not decode to a valid key is not adopted
        return None


def _record(kind: int, body: bytes) -> bytes:
    crc = zlib.crc32(bytes([kind]) + body)
    return RECORD.pack(len(body), kind) + body + struct.pack("<I", crc)


def commit_record(c: Committed) -> bytes:
    parent = c.parent or b""
    body = COMMIT_FIXED.pack(c.offset, c.size, c.checksum, len(parent)) + parent + _encode_key(c.key)
    if c.tail is None:
        return _record(COMMIT, body)
    groups = msgpack.packb(list(c.tail.groups), use_bin_type=True)
    return _record(TAIL, TAIL_FIXED.pack(c.tail.length, len(groups)) + groups + body)


def _decode_groups(raw: bytes) -> tuple[str, ...] | None:
    try:
        groups = msgpack.unpackb(raw, raw=False)
    except Exception:
        return None
    if not (isinstance(groups, list) and groups and all(isinstance(g, str) for g in groups)):
        return None
    return tuple(groups)


def _decode_commit(kind: int, body: bytes) -> tuple[int, Committed | None] | None:
    tail: TailMark | None = None
    if kind == TAIL:  # a tail's mark, then the COMMIT body
        if len(body) < TAIL_FIXED.size:
            return None
        length, glen = TAIL_FIXED.unpack_from(body)
        groups = _decode_groups(body[TAIL_FIXED.size : TAIL_FIXED.size + glen])
        body = body[TAIL_FIXED.size + glen :]
        tail = TailMark(length, groups) if groups is not None and length > 0 else None
    elif kind != COMMIT:
        return None
    if len(body) < COMMIT_FIXED.size:
        return None
    offset, size, checksum, plen = COMMIT_FIXED.unpack_from(body)
    parent = body[COMMIT_FIXED.size : COMMIT_FIXED.size + plen] or None
    key = _decode_key(body[COMMIT_FIXED.size + plen :])
    ok = key is not None and (parent is None or len(parent) == plen)
    return offset, Committed(key, offset, size, checksum, parent, tail) if ok and key is not None else None


def read_journal(path: Path, identity: tuple[int, int], capacity: int) -> tuple[list[Committed], str]:
    """The ready objects an L1 journal names, or ([], why not) when it is absent, foreign or of another format.
    A tail record whose mark does not decode is adopted as a plain object (never found as a tail)."""
    return read_records(path, identity, capacity, MAGIC, _decode_commit)


def read_records(
    path: Path,
    identity: tuple[int, int],
    capacity: int,
    magic: bytes,
    decode: Callable[[int, bytes], tuple[int, T | None] | None],
) -> tuple[list[T], str]:
    """Replay a journal of `magic`: the objects its COMMIT (and TAIL) records name and no later FREE
    record freed.

    `decode` turns a record's kind and body into (offset, object), the object None when the record is
    well formed but names nothing adoptable (it still frees its offset), or None when the body is
    garbage or of a kind it does not know (replay stops there, as at a torn record). Opened without
    following links and checked on the open descriptor: only this user's 0600 regular file is read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return [], "no journal"
    except OSError as exc:
        return [], f"cannot open its journal: {exc.strerror}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o600:
            return [], "its journal is not this user's 0600 regular file"
        data = b""
        while chunk := os.read(fd, 1 << 20):
            data += chunk
    finally:
        os.close(fd)
    if len(data) < HEADER.size:
        return [], "its journal has no header"
    got_magic, fmt, dev, ino, cap = HEADER.unpack_from(data)
    if got_magic != magic or fmt not in READS:
        return [], f"its journal is of another format ({fmt}, this server reads {', '.join(map(str, READS))})"
    if (dev, ino) != identity or cap != capacity:
        return [], "its journal belongs to another arena or size"
    live: dict[int, T] = {}
    pos = HEADER.size
    while pos + RECORD.size <= len(data):
        length, kind = RECORD.unpack_from(data, pos)
        end = pos + RECORD.size + length + 4
        if length > MAX_RECORD or end > len(data):
            break  # a torn last record (killed mid-append)
        body = data[pos + RECORD.size : end - 4]
        if zlib.crc32(bytes([kind]) + body) != struct.unpack_from("<I", data, end - 4)[0]:
            break
        pos = end
        if kind == FREE and len(body) == FREE_FIXED.size:
            live.pop(FREE_FIXED.unpack(body)[0], None)
        elif kind != FREE and (decoded := decode(kind, body)) is not None:
            offset, obj = decoded
            if obj is not None:
                live[offset] = obj
            else:
                live.pop(offset, None)
        else:
            break
    return list(live.values()), ""


class ArenaJournal(Generic[T]):
    """The append side: one open 0600 file, written by the server's loop only.

    `encode` makes one COMMIT record of an object (L1's by default; the encoder cache has its own,
    under its own magic, ec/journal.py)."""

    def __init__(
        self,
        path: Path,
        identity: tuple[int, int],
        capacity: int,
        magic: bytes = MAGIC,
        encode: Callable[[T], bytes] = commit_record,  # type: ignore[assignment]
    ) -> None:
        self.path = path
        self._encode = encode
        self._header = HEADER.pack(magic, FORMAT, identity[0], identity[1], capacity)
        self._fd = self._create(path)
        self.records = 0
        self.live = 0

    def _create(self, path: Path) -> int:
        """A fresh journal under a temporary name, renamed over `path` (a crash never leaves half of one)."""
        tmp = path.with_name(path.name + ".new")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_APPEND, 0o600)
        os.write(fd, self._header)
        return fd

    def _install(self, fd: int) -> None:
        tmp = self.path.with_name(self.path.name + ".new")
        os.rename(tmp, self.path)
        old, self._fd = getattr(self, "_fd", -1), fd
        if old >= 0 and old != fd:
            os.close(old)

    def start(self, ready: Iterable[T] = ()) -> None:
        """Write the objects already known ready, then install the file under its name."""
        self._append_many(ready, self._fd)
        self._install(self._fd)

    def commit(self, c: T) -> None:
        self._write(self._encode(c))
        self.live += 1

    def free(self, offset: int) -> None:
        self._write(_record(FREE, FREE_FIXED.pack(offset)))
        self.live -= 1

    def due(self) -> bool:
        """Whether a rewrite would shrink the journal enough to be worth it."""
        return self.records > COMPACT_MIN and self.records > 4 * self.live

    def compact(self, ready: Iterable[T]) -> None:
        """Rewrite the journal as one COMMIT per ready object; the rename makes the switch atomic."""
        fd = self._create(self.path)
        self.records = self.live = 0
        self._append_many(ready, fd)
        self._install(fd)

    def _append_many(self, ready: Iterable[T], fd: int) -> None:
        buf = bytearray()
        for c in ready:
            buf += self._encode(c)
            self.records += 1
            self.live += 1
            if len(buf) > 1 << 20:
                os.write(fd, buf)
                buf.clear()
        if buf:
            os.write(fd, buf)

    def _write(self, record: bytes) -> None:
        os.write(self._fd, record)
        self.records += 1

    def close(self, remove: bool) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if remove:
            self.path.unlink(missing_ok=True)
