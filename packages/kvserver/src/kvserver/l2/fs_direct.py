"""The fs tier's aligned files and O_DIRECT reads (`fs:///path?direct=1`).

Why: a read from the device through the page cache moves every byte twice (device to page cache,
then a CPU copy into the L1 slot) and fills the cache with objects L1 now holds. With O_DIRECT the
device writes straight into the slot. A file whose pages are all cached is still read through the
cache (a copy from memory beats the device); cachestat(2) (Linux 6.5) says which, and without it
every read goes through the cache.

O_DIRECT needs the file offset, the length and the memory address aligned to the device's block,
so a direct tier writes its files framed: the blob's header, zeros up to ALIGN, then the body, which
lands at an aligned offset into the 4 KiB-aligned slot. The blob itself (header, checksums) is the
same as in a plain file, and a file's framing follows from its size and the body length its header
states, so any server of this release reads both kinds whatever its own setting.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import struct
import threading

from .base import BlobParts

ALIGN = 4096  # where a framed body starts: a multiple of any device's logical block
BLOCK = 512  # O_DIRECT's granularity here (statx's dio alignment; 512 on every device we target)
HEAD = 64  # the blob header this release writes (serde version 3)
_BODY_LEN = struct.Struct("<Q")  # the header's body length, at byte 32
_ZEROS = bytes(ALIGN - HEAD)


def frame(parts: BlobParts) -> BlobParts:
    """The parts of a framed file: the header, zeros up to ALIGN, the body (a header + body blob only)."""
    if len(parts) != 2 or len(parts[0]) != HEAD:
        return parts
    return (parts[0], _ZEROS, parts[1])


def framed_size(size: int, body: int) -> bool:
    """A file of `size` bytes holding a body of `body` bytes is framed."""
    return size == ALIGN + body


def unframe(blob: bytes) -> bytes:
    """The blob a file holds: a framed file's header and body joined; anything else as it is (a
    plain file, or bytes the decoder will refuse)."""
    if len(blob) < ALIGN or len(blob) != ALIGN + _BODY_LEN.unpack_from(blob, 32)[0]:
        return blob
    if blob[HEAD:ALIGN] != _ZEROS:
        return blob  # not zeros where the frame has them: left for the decoder to refuse
    return blob[:HEAD] + blob[ALIGN:]


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


_NR_CACHESTAT = 451  # the same number on every architecture (the generic syscall table)
_PAGE = mmap.PAGESIZE


class PageCacheProbe:
    """Whether a file range is wholly in the page cache (cachestat), or None where it cannot tell."""

    def __init__(self) -> None:
        self._libc: ctypes.CDLL | None = None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.syscall.restype = ctypes.c_long
            self._libc = libc
            if self.cached(-1, 0, 1) is None and ctypes.get_errno() == 38:  # ENOSYS: an older kernel
                self._libc = None
        except OSError:
            self._libc = None

    @property
    def available(self) -> bool:
        return self._libc is not None

    def cached(self, fd: int, offset: int, length: int) -> bool | None:
        if self._libc is None:
            return None
        rng, st = _Range(offset, length), _CacheStat()
        if self._libc.syscall(_NR_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) != 0:
            return None
        return st.cache >= (offset + length + _PAGE - 1) // _PAGE - offset // _PAGE


class DirectReader:
    """Reads the body of a framed file into an aligned destination, with O_DIRECT when the file is
    not cached; per-thread aligned buffers take the frame's head and the body's last partial block."""

    def __init__(self, direct: bool) -> None:
        self.probe = PageCacheProbe() if direct else None
        self._local = threading.local()
        self.direct_reads = 0  # reads that bypassed the page cache

    def _buffers(self) -> tuple[memoryview, memoryview]:
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            region = mmap.mmap(-1, ALIGN + BLOCK)  # page-aligned, as O_DIRECT needs
            view = memoryview(region)
            bufs = self._local.bufs = (view[:ALIGN], view[ALIGN:])
        return bufs

    def read(self, fd: int, size: int, dest: memoryview) -> bytes | None:
        """Read a framed file of `size` bytes: its header (HEAD bytes) with the body in `dest`, or None
        when it is not framed as its size says (the caller reads it whole)."""
        head, tail = self._buffers()
        if self._direct_ok(fd, size, dest):
            whole = len(dest) // BLOCK * BLOCK
            views = [head, dest[:whole]] + ([tail] if whole < len(dest) else [])
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
            try:
                got = _preadv_all(fd, views, size)
            finally:  # the caller may read the file again, whole and buffered
                fcntl.fcntl(fd, fcntl.F_SETFL, flags)
            if got == size and whole < len(dest):
                dest[whole:] = tail[: len(dest) - whole]
            self.direct_reads += 1
        else:
            got = _preadv_all(fd, [head, dest], size)
        if got != size or head[HEAD:].tobytes() != _ZEROS or _BODY_LEN.unpack_from(head, 32)[0] != len(dest):
            return None
        return bytes(head[:HEAD])

    def _direct_ok(self, fd: int, size: int, dest: memoryview) -> bool:
        if self.probe is None or dest.readonly or not dest.c_contiguous:
            return False
        address = ctypes.addressof(ctypes.c_char.from_buffer(dest))
        return address % BLOCK == 0 and self.probe.cached(fd, 0, size) is False


def _preadv_all(fd: int, views: list[memoryview], size: int) -> int:
    """preadv until `size` bytes or the end of the file: how many were read."""
    offset = 0
    views = [v for v in views if len(v)]
    while views and offset < size:
        got = os.preadv(fd, views, offset)
        if got == 0:
            break
        offset += got
        while views and got >= len(views[0]):
            got -= len(views[0])
            views.pop(0)
        if views and got:  # a short read (O_DIRECT: block-aligned, unless at the file's end)
            views[0] = views[0][got:]
    return min(offset, size)


__all__ = ["ALIGN", "DirectReader", "PageCacheProbe", "frame", "framed_size", "unframe"]
