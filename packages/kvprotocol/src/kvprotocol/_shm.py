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
import errno
import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path

SHM_DIR = Path("/dev/shm")
HEADER_BYTES = 4096  # one page: magic + nonce; objects live above it
MAGIC = b"KVSARENA"
NONCE_BYTES = 16
POPULATE_STEP = 64 << 20  # populate() works in steps this size: close() waits for one step at most
_MADV_POPULATE_READ = 22  # Linux >= 5.14 (Python 3.11's mmap module does not name it)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def shm_exists(name: str) -> bool:
    """True when /dev/shm/<name> is a regular file (the server's arena is visible from here)."""
    try:
        return (SHM_DIR / name).is_file()
    except OSError:
        return False


def _written(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """[start, end) ranges of the file below `size` that hold written data (lseek SEEK_DATA/SEEK_HOLE)."""
    offset = 0
    while offset < size:
        try:
            data = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data past offset
                return
            raise
        if data >= size:
            return
        offset = min(os.lseek(fd, data, os.SEEK_HOLE), size)
        yield data, offset


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
            raise OSError(exc.errno, f"cannot open {self.path} (is the server on this host?): {exc.strerror}") from None
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
        self._lock = threading.Lock()  # populate() never touches the range once close() unmapped it

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
        return head[len(MAGIC) :].hex() if head.startswith(MAGIC) else ""

    def write_header(self, nonce: str) -> None:
        """The server stamps a new arena with the magic and its instance nonce."""
        self.mm[: len(MAGIC) + NONCE_BYTES] = MAGIC + bytes.fromhex(nonce)

    def check_range(self, offset: object, size: object) -> None:
        """Refuse offsets from a reply that would reach outside the mapping (never segfault)."""
        if (
            not (isinstance(offset, int) and isinstance(size, int))
            or offset < 0
            or size < 0
            or offset + size > self.size
        ):
            raise ValueError(f"object [{offset}, +{size}) lies outside the {self.size}-byte arena")

    def populate(self) -> int:
        """Fill this mapping's page tables for every page the arena file already has; returns the bytes.

        Why: the first copy into or out of each page of a fresh mapping takes a page fault; on this
        project's VM a first-touch copy ran at 2.1 GB/s writing and 5.6 GB/s reading against
        10.5-12 GB/s once mapped, and populating 1 GiB took 0.09 s. An engine runs this on a thread
        of its own right after mapping (`populate_in_background`). Populating a hole would allocate
        it, so a sparse arena stays sparse: a fully allocated file (the server's --prefault) is
        populated whole, any other only where it was written (lseek SEEK_DATA, which on tmpfs skips
        allocated but unwritten pages too). Stops quietly at the first error (a kernel before 5.14:
        EINVAL) or once closed.
        """
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return 0
        done = 0
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != self.identity:
                return 0  # the name leads to another arena now: its extents say nothing of ours
            full = st.st_blocks * 512 >= self.size
            for start, end in [(0, self.size)] if full else _written(fd, self.size):
                for step in range(start, end, POPULATE_STEP):
                    length = min(POPULATE_STEP, end - step)
                    with self._lock:
                        if self._mm is None or _libc.madvise(self.address + step, length, _MADV_POPULATE_READ):
                            return done
                    done += length
        except OSError:
            return done
        finally:
            os.close(fd)
        return done

    def populate_in_background(self) -> threading.Thread:
        """`populate` on a daemon thread (madvise releases the GIL through ctypes)."""
        thread = threading.Thread(target=self.populate, name=f"populate-{self.name}", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """Unmap; if a view is still exported (a frame in flight, a CUDA copier's tensor), leave it to the GC."""
        with self._lock:
            mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass
