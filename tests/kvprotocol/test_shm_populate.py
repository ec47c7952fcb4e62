"""ShmMapping.populate: a mapping's page tables are filled for the pages the arena file already has
(so an engine's first copy through a page does not fault), and never for its holes: a sparse arena
stays sparse. Observed through the kernel's own accounting: the mapping's Rss in /proc/self/smaps
and the file's allocated blocks."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtestkit.kvhelpers import mapped_rss
from kvprotocol._shm import POPULATE_STEP, SHM_DIR, ShmMapping

MIB = 1 << 20


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


@pytest.fixture
def arena_file() -> Iterator[Path]:
    path = SHM_DIR / f"kvtest-populate-{secrets.token_hex(4)}"
    yield path
    path.unlink(missing_ok=True)


def server_arena(path: Path, size: int, allocate: tuple[int, int] | None) -> ShmMapping:
    """The server's side: a new arena file, with [offset, offset + length) allocated (fallocate)."""
    owner = ShmMapping(path.name, size, create=True)
    if allocate is not None:
        fd = os.open(path, os.O_RDWR)
        os.posix_fallocate(fd, *allocate)
        os.close(fd)
    return owner


def test_populate_maps_every_allocated_page(arena_file: Path) -> None:
    size = 2 * POPULATE_STEP + 3 * MIB  # more than one step, and a partial last one
    owner = server_arena(arena_file, size, (0, size))  # what the server's --prefault does
    engine = ShmMapping(arena_file.name, size)
    try:
        assert mapped_rss(engine.address) < size // 16  # a fresh mapping: nothing mapped yet
        assert engine.populate() == size
        assert mapped_rss(engine.address) == size
    finally:
        engine.close()
        owner.close()


def test_populate_leaves_holes_unallocated(arena_file: Path) -> None:
    size = 32 * MIB
    owner = server_arena(arena_file, size, None)
    fd = os.open(arena_file, os.O_RDWR)
    os.pwrite(fd, b"\x01" * MIB, 8 * MIB)  # one written extent in the middle of a sparse file
    os.close(fd)
    before = allocated(arena_file)
    engine = ShmMapping(arena_file.name, size)
    try:
        assert engine.populate() == MIB
        assert allocated(arena_file) == before  # no hole was filled
        assert MIB <= mapped_rss(engine.address) < 2 * MIB
        assert engine.mm[8 * MIB] == 1
    finally:
        engine.close()
        owner.close()


def test_populate_after_close_or_a_replaced_file_does_nothing(arena_file: Path) -> None:
    size = 4 * MIB
    owner = server_arena(arena_file, size, (0, size))
    closed = ShmMapping(arena_file.name, size)
    closed.close()
    assert closed.populate() == 0  # closed: nothing populated, and no error

    stale = ShmMapping(arena_file.name, size)
    owner.close()
    arena_file.unlink()  # a restarted server: the name now leads to another (sparse) file
    replacement = server_arena(arena_file, size, None)
    fd = os.open(arena_file, os.O_RDWR)
    os.pwrite(fd, b"\x01" * MIB, 0)  # with data of its own, which says nothing of the stale mapping's pages
    os.close(fd)
    try:
        assert stale.populate() == 0
        assert allocated(arena_file) < size  # the other file's holes stay holes
    finally:
        stale.close()
        replacement.close()
