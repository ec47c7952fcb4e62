"""The L1 journal's records (l1/journal.py): tails keep their mark through a write and a replay, and a
journal of the previous format (1, before TAIL records) is still adopted."""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

from kvprotocol import ObjectKey
from kvserver.l1.journal import COMMIT, HEADER, MAGIC, RECORD, ArenaJournal, Committed, TailMark, read_journal

ID, CAP = (7, 11), 1 << 20
KEY = ObjectKey("m", "0" * 16, 1, 0, 0, "", b"k" * 32)


def _journal(tmp_path: Path, objects: list[Committed]) -> Path:
    path = tmp_path / "arena.journal"
    j: ArenaJournal[Committed] = ArenaJournal(path, ID, CAP)
    j.start(objects)
    j.close(remove=False)
    return path


def test_a_tail_keeps_its_length_and_key_space_through_the_journal(tmp_path: Path) -> None:
    tail = Committed(KEY, 4096, 512, 99, b"p" * 32, TailMark(100, ("0" * 16, "1" * 16)))
    plain = Committed(KEY._replace(chunk_hash=b"q" * 32), 8192, 512, 98, None)
    found, why = read_journal(_journal(tmp_path, [tail, plain]), ID, CAP)
    assert why == "" and sorted(found, key=lambda c: c.offset) == [tail, plain]


def test_a_journal_of_format_1_is_still_adopted(tmp_path: Path) -> None:
    path = tmp_path / "old.journal"
    body = struct.pack("<QQQB", 4096, 512, 99, 0) + b"".join(
        [b"\x97", b"\xa1m", b"\xb0" + b"0" * 16, b"\x01", b"\x00", b"\x00", b"\xa0", b"\xc4\x20" + b"k" * 32]
    )
    record = RECORD.pack(len(body), COMMIT) + body + struct.pack("<I", zlib.crc32(bytes([COMMIT]) + body))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, HEADER.pack(MAGIC, 1, *ID, CAP) + record)
    os.close(fd)
    found, why = read_journal(path, ID, CAP)
    assert why == "" and found == [Committed(KEY, 4096, 512, 99, None)]
    fd = os.open(path, os.O_WRONLY)
    os.write(fd, HEADER.pack(MAGIC, 3, *ID, CAP))  # a format this server does not know
    os.close(fd)
    assert read_journal(path, ID, CAP) == ([], "its journal is of another format (3, this server reads 1, 2)")
