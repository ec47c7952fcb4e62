"""Evicting files from the page cache without root, so a benchmark's next read comes from the device."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def drop_cache(paths: Iterable[Path]) -> None:
    """Write each file's pages back (fsync), then evict them (POSIX_FADV_DONTNEED: clean pages go)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
