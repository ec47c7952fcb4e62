"""The fs tier's writes: a file appears under its final name only whole.

A write goes to an unnamed file (`O_TMPFILE`) in the object's own directory, linked under its name
once whole: a reader never sees a partial object and a crash mid-write leaves nothing. Where the
file system has no `O_TMPFILE` (or there is no /proc to name the file through) writes go to a temp
file under `tmp/`, renamed into place (a crash leaves the temp file, swept at start when older than
an hour, since another server may share the directory). An unnamed file for a key already held
replaces it by unlink + link (a reader in between sees a miss), which also spares ext4's writeback
on a rename over a file. With `fsync` each file is synced before it is named, so a file under its
final name is whole after a power loss; its directory's sync is the caller's, once per batch.
Without it a power loss can lose recent puts or leave a torn file, which the integrity header
turns into a miss. Files are 0600 and directories 0700 whatever the umask.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
import uuid

from .base import BlobParts

STALE_TMP_S = 3600.0
DIR_MODE, FILE_MODE = 0o700, 0o600
# what open(O_TMPFILE) or linkat through /proc/self/fd fail with where they are not supported
UNNAMED_UNSUPPORTED = frozenset({errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.EPERM, errno.EXDEV})


class WholeFileWriter:
    """Puts whole files in place under `tmp_dir`'s tier; one per tier, shared by its worker threads."""

    def __init__(self, tmp_dir: str, *, fsync: bool) -> None:
        self.tmp_dir = tmp_dir
        self.fsync = fsync
        self._proc_fd: tuple[int, int] | None = None  # (pid, fd of /proc/self/fd): names for unnamed files

    def open(self) -> None:
        """Sweep stale temp files and open /proc/self/fd, through which an unnamed file gets its
        name; without it (no /proc, or a file system without O_TMPFILE: `write` then closes it)
        writes go through named temp files."""
        self.sweep_stale()
        self.close_proc_fd()
        try:
            self._proc_fd = (os.getpid(), os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY))
        except OSError:
            self._proc_fd = None

    def close_proc_fd(self) -> None:
        if self._proc_fd is not None:
            os.close(self._proc_fd[1])
            self._proc_fd = None

    def sweep_stale(self) -> None:
        """Remove temp files older than STALE_TMP_S: a crashed writer's (a younger one may be another
        server's, still writing)."""
        cutoff = time.time() - STALE_TMP_S
        for entry in os.scandir(self.tmp_dir):
            try:  # only our own regular files: never follow a link out of the tier
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and st.st_mtime < cutoff:
                    os.unlink(entry.path)
            except OSError:
                pass  # another server removed or renamed it meanwhile

    def write(self, final: str, parts: BlobParts) -> None:
        """`parts` as the file `final`, whole or not at all."""
        proc = self._proc_fd
        if proc is not None and proc[0] == os.getpid():
            try:
                self._write_unnamed(final, parts, proc[1])
                return
            except OSError as exc:
                if exc.errno not in UNNAMED_UNSUPPORTED:
                    raise
                self.close_proc_fd()  # no O_TMPFILE here, or no linking through /proc: named temp files
        self._write_named(final, parts)

    def _write_unnamed(self, final: str, parts: BlobParts, proc_fd: int) -> None:
        """Write an unnamed file (O_TMPFILE) in the object's own directory, then link it under its
        name: only one directory changes (a named temp file costs a second directory's entry and a
        rename across them)."""
        directory = os.path.dirname(final)
        try:
            fd = os.open(directory, os.O_WRONLY | os.O_TMPFILE, FILE_MODE)
        except FileNotFoundError:  # the first object in this fan-out directory
            os.makedirs(directory, mode=DIR_MODE, exist_ok=True)
            fd = os.open(directory, os.O_WRONLY | os.O_TMPFILE, FILE_MODE)
        try:
            write_all(fd, parts)
            if self.fsync:
                os.fsync(fd)
            try:
                os.link(str(fd), final, src_dir_fd=proc_fd, follow_symlinks=True)
            except FileExistsError:  # a put of a key held replaces it, as a rename over it would
                unlink(final)
                with contextlib.suppress(FileExistsError):  # another writer's object landed meanwhile
                    os.link(str(fd), final, src_dir_fd=proc_fd, follow_symlinks=True)
        finally:
            os.close(fd)

    def _write_named(self, final: str, parts: BlobParts) -> None:
        tmp = f"{self.tmp_dir}/{os.path.basename(final)[:16]}-{uuid.uuid4().hex}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
            try:
                write_all(fd, parts)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.replace(tmp, final)
            except FileNotFoundError:  # the first object in this fan-out directory
                os.makedirs(os.path.dirname(final), mode=DIR_MODE, exist_ok=True)
                os.replace(tmp, final)
        except BaseException:
            unlink(tmp)
            raise


def write_all(fd: int, parts: BlobParts) -> None:
    """writev every part, resuming after a short write (signals, >2 GiB)."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        done = os.writev(fd, views)
        while views and done >= len(views[0]):
            done -= len(views[0])
            views.pop(0)
        if views and done:
            views[0] = views[0][done:]


def unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
