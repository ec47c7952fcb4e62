"""The L1 arena: one POSIX shared-memory segment that the server owns and engines map.

It is a file under /dev/shm (what shm_open creates on Linux), sized with ftruncate so pages are only
backed when touched. Its name derives from the ZMQ port, so the segment a stopped or crashed server
left is found by the next server started on that port, which adopts it (warm restart: its objects
are re-adopted from the journal beside it, journal.py) when it is this user's 0600 regular file of
the same size and arena format, and otherwise removes it and starts empty with one log line.

One server per arena, always: a server first takes an exclusive lock (`<name>.lock` next to the
segment, held for its whole life), and only a server holding it may remove or create the segment.
A second server for the same name finds the lock taken and stops without touching anything. The
first HEADER_BYTES of the segment carry a magic and a random instance nonce, which register_engine
also returns: an engine that mapped some other file under the name (a stale or foreign arena)
sees a different nonce and misses instead of reading it.

/dev/shm is writable by every local user, so another user can create either name first (a
squatter). The server never opens, locks or removes a file there that is not its own user's
regular file: it refuses to start with an error naming the owner's uid and the way out
(`ArenaSquatted`). Using a private 0700 directory instead would remove the squatting altogether,
but engines find the arena by a name under /dev/shm, so it would change what they map.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import pwd
import secrets
import stat
import struct
import threading
from pathlib import Path

import numpy as np
from kvprotocol._shm import HEADER_BYTES, MAGIC, NONCE_BYTES, SHM_DIR, ShmMapping
from kvprotocol.kvsum import kvsum64_array

log = logging.getLogger("kvserver.arena")

__all__ = [
    "HEADER_BYTES",
    "SHM_DIR",
    "Arena",
    "ArenaBusy",
    "ArenaLock",
    "ArenaSquatted",
    "ShmTooSmall",
    "arena_name",
    "check_free_space",
]


ARENA_FORMAT = 1  # the arena header's format; an arena of another format is never adopted
_FORMAT_AT = len(MAGIC) + NONCE_BYTES  # after magic and nonce (what engines read): format, capacity
_FORMAT = struct.Struct("<IQ")


def arena_name(port: int, prefix: str = "kvserver") -> str:
    return f"{prefix}-{port}"


class ArenaBusy(RuntimeError):
    """Another live server holds this arena's lock."""


class ArenaSquatted(ArenaBusy):
    """A file under the arena's name is another user's (or not a regular file): not ours to use."""


def check_own(path: Path) -> None:
    """Raise ArenaSquatted when `path` exists and is not a regular file of this process's user."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
        return
    try:
        who = f"uid {st.st_uid} ({pwd.getpwuid(st.st_uid).pw_name})"
    except KeyError:
        who = f"uid {st.st_uid}"
    what = "a regular file" if stat.S_ISREG(st.st_mode) else "not a regular file"
    raise ArenaSquatted(
        f"{path} belongs to {who} and is {what}; this server (uid {os.geteuid()}) will not use or remove "
        f"another user's file. Remove it (as root or that user: rm {path}), or start this server "
        "with another --port or --shm-prefix"
    )


def _remove_own_link(path: Path) -> None:
    """A symbolic link of ours under the arena's name is never followed nor adopted: it is removed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode) and st.st_uid == os.geteuid():
        log.warning("arena %s: removed a symbolic link in its place (never adopted)", path)
        path.unlink()


class ShmTooSmall(RuntimeError):
    """/dev/shm has less free space than the arena needs."""


class ArenaLock:
    """An exclusive flock on /dev/shm/<name>.lock, with the owner's pid written into it.

    The lock file is only ever unlinked by its lock holder; after locking we check that the path
    still names the file we locked (a previous holder may have unlinked it meanwhile), so two
    servers can never both believe they hold the lock.
    """

    def __init__(self, name: str) -> None:
        self.path = SHM_DIR / f"{name}.lock"
        for _ in range(100):
            check_own(self.path)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                owner = _read_pid(fd)
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                    raise ArenaBusy(
                        f"another kvserver{f' (pid {owner})' if owner else ''} owns the arena "
                        f"/dev/shm/{name}; stop it first, or start this one with another "
                        "--port or --shm-prefix"
                    ) from None
                raise
            if os.fstat(fd).st_uid != os.geteuid():  # created by another user between the check and the open
                os.close(fd)
                check_own(self.path)
                raise ArenaSquatted(f"{self.path} is not this server's user's file")
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._fd: int | None = fd
                os.ftruncate(fd, 0)
                os.pwrite(fd, str(os.getpid()).encode(), 0)
                return
            os.close(fd)  # we locked a file its holder unlinked on the way out: try the new one
        raise ArenaBusy(f"could not lock {self.path}: it keeps being replaced")

    def release(self) -> None:
        """Unlink the lock file while still holding it, then let go; safe to call twice."""
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None


def _read_pid(fd: int) -> int:
    try:
        return int(os.pread(fd, 32, 0).decode().strip() or 0)
    except (OSError, ValueError):
        return 0


def check_free_space(name: str, size: int) -> None:
    """Refuse an arena that /dev/shm cannot hold (a sparse file would die of SIGBUS later instead).

    A stale segment of the same name (ours to remove) counts as free.
    """
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    try:
        free += os.stat(SHM_DIR / name).st_blocks * 512
    except FileNotFoundError:
        pass
    if size > free:
        gib = 1 << 30
        raise ShmTooSmall(
            f"--l1-size-gb needs {size / gib:.2f} GiB in /dev/shm but only {free / gib:.2f} GiB is free. "
            "Give the server more shared memory (docker run --shm-size=<size>, e.g. --shm-size=8g; "
            "Kubernetes: mount an emptyDir with medium: Memory and a sizeLimit at /dev/shm) "
            "or lower --l1-size-gb."
        )


class Arena:
    """A shared-memory region with a writable memoryview over it; the caller holds its ArenaLock.

    `capacity` bytes for objects lie above the header page, so the segment is HEADER_BYTES larger.
    """

    def __init__(self, name: str, capacity: int, prefault: bool = False, adopt: bool = False) -> None:
        """`prefault`: allocate every page of the segment now, on a thread of its own (see _prefault).
        `adopt`: keep a segment left by a previous server if it is fit for adoption (`adopted` says)."""
        if capacity <= 0:
            raise ValueError("arena capacity must be positive")
        self.name = name
        self.capacity = capacity
        self.size = size = capacity + HEADER_BYTES  # what engines map
        self.path = SHM_DIR / name
        self.nonce = secrets.token_hex(NONCE_BYTES)
        self.adopted = False
        self.not_adopted = ""  # why a segment found under the name was not adopted
        self._checked: tuple[int, int] = (-1, -1)  # the (device, inode) that _unfit found fit
        _remove_own_link(self.path)
        check_own(self.path)  # a stale segment of ours is adopted or removed below; another user's never
        self.removed_stale = False
        if self.path.exists():
            why = self._unfit() if adopt else "a cold start was asked for"
            if why:
                self.not_adopted = why
                self.removed_stale = True
                self.path.unlink()  # its owner is gone: we hold the lock that every live owner holds
        if self.path.exists():
            self._map = ShmMapping(name, size)
            if self._map.identity != self._checked:  # replaced since the check (only root or we can)
                self._map.close()
                raise ArenaBusy(f"{self.path} changed while it was being adopted")
            self.adopted = True
        else:
            self._map = ShmMapping(name, size, create=True)
        self._map.write_header(self.nonce)  # a new instance: engines of the old one see another nonce
        self._map.mm[_FORMAT_AT : _FORMAT_AT + _FORMAT.size] = _FORMAT.pack(ARENA_FORMAT, capacity)
        self.identity = self._map.identity
        self.view = memoryview(self._map.mm)
        self._stop = threading.Event()
        self.prefaulted = threading.Event()  # set once every page is allocated (or prefaulting gave up)
        if prefault:
            threading.Thread(target=self._prefault, name=f"prefault-{name}", daemon=True).start()

    def _unfit(self) -> str:
        """Why the segment under our name may not be adopted ("" when it may).

        Opened without following links and checked on the open descriptor: only this user's 0600
        regular file of this arena's size and format (another user's file would feed the cache).
        """
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            return f"cannot open it: {exc.strerror}"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                return "it is not this user's regular file"
            if stat.S_IMODE(st.st_mode) != 0o600:
                return f"its mode is {stat.S_IMODE(st.st_mode):o}, not 600"
            if st.st_size != self.size:
                return f"its size is {st.st_size} bytes, this server's arena is {self.size}"
            head = os.pread(fd, _FORMAT_AT + _FORMAT.size, 0)
        finally:
            os.close(fd)
        if not head.startswith(MAGIC) or len(head) < _FORMAT_AT + _FORMAT.size:
            return "it has no arena header"
        fmt, cap = _FORMAT.unpack_from(head, _FORMAT_AT)
        if fmt != ARENA_FORMAT or cap != self.capacity:
            return f"its format is {fmt} (this server adopts {ARENA_FORMAT})"
        self._checked = (st.st_dev, st.st_ino)
        return ""

    def _prefault(self) -> None:
        """Allocate the segment's pages (fallocate: zeroed tmpfs pages), then map them in this
        server's own mapping (ShmMapping.populate).

        Why: a sparse segment gets each page at its first write, and on the engine's side that first
        write is a page fault that allocates and zeroes it: 1 GB/s here against 12 GB/s into a page
        that exists. With the pages allocated up front an engine's first write into one only maps
        it. The server writes into its mapping too (an L2 prefetch reads objects straight into their
        slots), and there a first write into an allocated but unmapped page still faults, to map
        it: a prefetch of 256 MiB into fresh slots took 0.2 s against 0.035 s into mapped ones
        (docs/l2.md). Runs beside serving (the syscalls release the GIL), in 64 MiB steps so
        close() stops it.
        """
        step = 64 << 20
        try:
            fd = os.open(self.path, os.O_RDWR)
        except OSError:
            self.prefaulted.set()
            return
        allocated = False
        try:
            for start in range(0, self.size, step):
                if self._stop.is_set():
                    break
                os.posix_fallocate(fd, start, min(step, self.size - start))
            else:
                allocated = True
        except OSError as exc:  # /dev/shm filled up meanwhile: pages come at first write, as without it
            log.warning("arena %s: prefault stopped: %s", self.name, exc)
        finally:
            os.close(fd)
        try:
            if allocated and not self._stop.is_set():
                self._map.populate()  # stops at close(); a kernel without MADV_POPULATE_READ: no-op
        finally:
            self.prefaulted.set()

    def write(self, offset: int, data: bytes | memoryview) -> None:
        self.view[offset : offset + len(data)] = data

    def read(self, offset: int, size: int) -> memoryview:
        return self.view[offset : offset + size]

    def kvsum(self, offset: int, size: int) -> int:
        """kvsum64 of the bytes at [offset, offset + size): what their writer's commit claims, if intact."""
        return kvsum64_array(np.frombuffer(self.view[offset : offset + size], dtype=np.uint8))

    def close(self, keep: bool = False) -> None:
        """Unmap, and remove the segment unless `keep` (left for the next server to adopt); safe twice."""
        self._stop.set()
        try:
            self.view.release()
        except (BufferError, ValueError):
            pass
        self._map.close()  # with a view still exported (a frame in flight) the GC unmaps; the unlink still frees it
        if not keep:
            self.path.unlink(missing_ok=True)
