"""The one mapping of a server's /dev/shm arena: the server creates it, engines, kvcli and tests map it.

Why one class: the arena file is recreated under the same name when a server restarts, so a mapping
can silently go stale. `is_current()` compares the mapped file's identity (device, inode) with what
the name points to now; while we hold the mapping, its inode cannot be reused, so "same identity
before and after an operation" proves no other arena was created in between. The arena's first
bytes carry the server's instance nonce (docs/protocol.md, "Arena header"): a mapping whose nonce
differs from the one register_engine returned is some other server's arena, never read or written.
Torch- and numpy-free: callers that want an array view make one over `mm`.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")
HEADER_BYTES = 4096  # one page: magic + nonce; objects live above it
MAGIC = b"KVSARENA"
NONCE_BYTES = 16


def shm_exists(name: str) -> bool:
    """True when /dev/shm/<name> is a regular file (the server's arena is visible from here)."""
    try:
        return (SHM_DIR / name).is_file()
    except OSError:
        return False


class ShmMapping:
    """A read-write mapping of /dev/shm/<name> with its base address and file identity.

    `create=True` (the server) makes a new 0600 file of `size` bytes and fails if the name exists;
    otherwise an existing file of at least `size` bytes is mapped.
    """

    def __init__(self, name: str, size: int, create: bool = False) -> None:
        if "/" in name or name in ("", ".", "..") or size <= 0:
            raise ValueError(f"bad arena name or size {name!r}, {size}")
        self.name = name
        self.size = size
        self.path = SHM_DIR / name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot open {self.path} (is the server on this host?): {exc.strerror}") \
                from None
        try:
            try:
                if create:
                    os.ftruncate(fd, size)  # pages are backed only when touched
                st = os.fstat(fd)
                if st.st_size < size:
                    raise ValueError(f"arena {name} has {st.st_size} bytes, the server announced {size}")
                self.identity = (st.st_dev, st.st_ino)
                self._mm: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException:
                if create:
                    self.path.unlink(missing_ok=True)
                raise
        finally:
            os.close(fd)
        anchor = ctypes.c_char.from_buffer(self._mm)
        self.address = ctypes.addressof(anchor)
        del anchor  # no buffer stays exported: close() can unmap

    @property
    def mm(self) -> mmap.mmap:
        if self._mm is None:
            raise ValueError("arena mapping is closed")
        return self._mm

    def is_current(self) -> bool:
        """Does /dev/shm/<name> still name the file we mapped (no server restart since)?"""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.identity

    def nonce(self) -> str:
        """The instance nonce in the mapped arena's header (hex), or "" when there is no header."""
        head = bytes(self.mm[: len(MAGIC) + NONCE_BYTES])
        return head[len(MAGIC):].hex() if head.startswith(MAGIC) else ""

    def write_header(self, nonce: str) -> None:
        """The server stamps a new arena with the magic and its instance nonce."""
        self.mm[: len(MAGIC) + NONCE_BYTES] = MAGIC + bytes.fromhex(nonce)

    def check_range(self, offset: object, size: object) -> None:
        """Refuse offsets from a reply that would reach outside the mapping (never segfault)."""
        if not (isinstance(offset, int) and isinstance(size, int)) or offset < 0 or size < 0 \
                or offset + size > self.size:
            raise ValueError(f"object [{offset}, +{size}) lies outside the {self.size}-byte arena")

    def close(self) -> None:
        """Unmap; if a view is still exported (a frame in flight, a CUDA copier's tensor), leave it to the GC."""
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass
