"""The L1 arena: one POSIX shared-memory segment that the server owns and engines map.

It is a file under /dev/shm (what shm_open creates on Linux), sized with ftruncate so pages are only
backed when touched. Its name derives from the ZMQ port, so a crashed server's segment is found and
removed by the next server started on that port.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def arena_name(port: int, prefix: str = "kvserver") -> str:
    return f"{prefix}-{port}"


class Arena:
    """A shared-memory region with a writable memoryview over it."""

    def __init__(self, name: str, size: int) -> None:
        if size <= 0:
            raise ValueError("arena size must be positive")
        self.name = name
        self.size = size
        self.path = SHM_DIR / name
        self.removed_stale = self.path.exists()
        if self.removed_stale:
            self.path.unlink()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.view = memoryview(self._mmap)

    def write(self, offset: int, data: bytes | memoryview) -> None:
        self.view[offset : offset + len(data)] = data

    def read(self, offset: int, size: int) -> memoryview:
        return self.view[offset : offset + size]

    def close(self) -> None:
        """Unmap and remove the segment; safe to call twice."""
        try:
            self.view.release()
            self._mmap.close()
        except (BufferError, ValueError):
            pass  # a view is still exported (e.g. a frame in flight); the unlink below still frees it
        self.path.unlink(missing_ok=True)

