"""The engine's mapping of the server's shared-memory arena (shm data plane).

Why a class of its own: the arena file is recreated under the same name when a server restarts, so a
mapping can silently go stale. `is_current()` compares the mapped file's identity (device, inode)
with what the name points to now; while we hold the mapping, its inode cannot be reused, so "same
identity before and after an operation" proves no other arena was created in between. The
arena's first bytes carry the server's instance nonce (docs/protocol.md, "Arena header"): a mapping
whose nonce differs from the one register_engine returned is some other server's arena (or a stale
one), and is never read or written.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

SHM_DIR = Path("/dev/shm")
MAGIC = b"KVSARENA"  # arena header: MAGIC, then the 16-byte instance nonce; objects start at 4096
NONCE_BYTES = 16


def shm_exists(name: str) -> bool:
    """True when /dev/shm/<name> is a regular file (the server's arena is visible from here)."""
    try:
        return (SHM_DIR / name).is_file()
    except OSError:
        return False


class ArenaMap:
    """A read-write mapping of /dev/shm/<name> with its base address and file identity."""

    def __init__(self, name: str, size: int) -> None:
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"bad arena name {name!r}")
        self.name = name
        self.size = size
        self.path = SHM_DIR / name
        fd = os.open(self.path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            if st.st_size < size:
                raise ValueError(f"arena {name} has {st.st_size} bytes, the server announced {size}")
            self.identity = (st.st_dev, st.st_ino)
            self._mm: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._view: np.ndarray | None = np.frombuffer(self._mm, dtype=np.uint8)
        self.address = int(self._view.__array_interface__["data"][0])

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

    def check_range(self, offset: object, size: object) -> None:
        """Refuse offsets from a reply that would reach outside the mapping (never segfault)."""
        if not (isinstance(offset, int) and isinstance(size, int)) or offset < 0 or size < 0 \
                or offset + size > self.size:
            raise ValueError(f"object [{offset}, +{size}) lies outside the {self.size}-byte arena")

    def close(self) -> None:
        """Unmap; if a view is still exported (e.g. a CUDA copier's tensor), leave it to the GC."""
        self._view = None
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass
