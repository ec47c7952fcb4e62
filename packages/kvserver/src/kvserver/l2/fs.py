"""`fs://` tier: one file per object in a directory (local NVMe or a shared filesystem).

A file's name is the BLAKE3 of its key (keys may hold '/' or '..', so they never become paths),
fanned out over 256 subdirectories. A blob is written whole under its name (`fs_write.py`: one
`writev` of its parts, the body straight from its L1 slot, into a file no reader sees partial) and
read with one `preadv` into a header buffer and the destination slot (`get_into`), so the bytes
cross memory once each way. With `fsync=1` each directory a batch wrote into is synced once after
the batch (not per file: a directory sync is a device flush), so a put that returned is durable.
A restarted server finds every object already there.
Object files are 0600 and directories 0700 whatever the umask: cached KV is a tenant's data.

With `capacity_gb` the tier is bounded: an in-memory index of its files in access order (rebuilt at
start from the files' access and modification times) evicts the least recently used files once the
bytes written exceed the capacity, and `usage` comes from the index instead of a directory walk. The
index is this server's view: servers sharing a directory should give it one capacity each, or one
of them the capacity and the others none.
"""

from __future__ import annotations

import asyncio
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from blake3 import blake3

from .base import BlobParts, Check, L2Adapter, L2Error, LazyBlob, Landed, Usage, blob_parts
from .fs_direct import DirectReader, frame, framed_size, unframe
from .fs_write import DIR_MODE, WholeFileWriter, fsync_dir, unlink

T = TypeVar("T")


class UntrustedRoot(L2Error):
    """The tier's directory is not this user's alone: the tier stays refused (never retried into)."""


def _private_dir(path: Path, *, follow: bool = False) -> None:
    """Create a 0700 directory, or check an existing one: ours, a directory, not a symlink (unless
    `follow`: the root the operator named may be one), and not writable by others (another user
    could have planted objects or links in it). Anything else refuses the tier, naming the path."""
    try:
        path.mkdir(mode=DIR_MODE)
        created = True
    except FileExistsError:
        created = False
    except OSError as exc:
        raise L2Error(f"cannot create {path}: {exc.strerror or exc}") from exc
    st = os.stat(path) if follow else os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UntrustedRoot(f"{path} is not a directory (a symlink or a file): refusing the fs tier")
    if st.st_uid != os.getuid():
        raise UntrustedRoot(
            f"{path} belongs to uid {st.st_uid}, not to this user: refusing the fs tier (use a directory of your own)"
        )
    if st.st_mode & 0o022 and not created:
        raise UntrustedRoot(
            f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}), so its "
            "contents cannot be trusted: check it and chmod 700 it, or use a fresh directory"
        )
    if stat.S_IMODE(st.st_mode) != DIR_MODE:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | (0 if follow else os.O_NOFOLLOW))
        try:
            os.fchmod(fd, DIR_MODE)
        finally:
            os.close(fd)


class FsAdapter(L2Adapter):
    takes_parts = True

    def __init__(
        self,
        root: str | Path,
        *,
        fsync: bool = False,
        url: str | None = None,
        capacity: int | None = None,
        direct: bool = False,
    ) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self.direct = direct  # framed files, read with O_DIRECT when not cached (fs_direct.py)
        self.reader = DirectReader(direct)
        self.capacity = capacity
        self._index: OrderedDict[str, int] = OrderedDict()  # file -> bytes, least recently used first
        self._bytes = 0
        self._lock = threading.Lock()  # the operations run on worker threads
        self.evicted = 0
        self.url = url or f"fs://{self.root}"
        self._objects = self.root / "objects"
        self._objects_dir = str(self._objects)
        self._tmp = self.root / "tmp"
        self._refused: L2Error | None = None
        self.writer = WholeFileWriter(str(self._tmp), fsync=fsync)

    def describe(self) -> dict[str, Any]:
        return {"direct": self.direct, "direct_reads": self.reader.direct_reads}

    def path_of(self, key: str) -> Path:
        return Path(self._file(key))

    def _file(self, key: str) -> str:
        """`path_of` as a string: the per-object paths stay strings (a Path costs microseconds an
        object, a visible share of a page-cache read of a MiB)."""
        digest = blake3(key.encode()).hexdigest()
        return f"{self._objects_dir}/{digest[:2]}/{digest[2:]}"

    async def start(self) -> None:
        try:
            await self._run(self._prepare)
        except UntrustedRoot as exc:
            self._refused = exc
            raise

    def _prepare(self) -> None:
        self.root.parent.mkdir(parents=True, exist_ok=True)
        _private_dir(self.root, follow=True)
        for path in (self._objects, self._tmp):
            _private_dir(path)
        self.writer.open()
        if self.capacity is not None:
            self._rebuild_index()

    async def close(self) -> None:
        self.writer.close_proc_fd()

    def _rebuild_index(self) -> None:
        found = []
        for sub in os.scandir(self._objects):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                found.append((max(st.st_atime, st.st_mtime), entry.path, st.st_size))
        found.sort(key=lambda f: f[0])
        with self._lock:
            self._index = OrderedDict((path, size) for _, path, size in found)
            self._bytes = sum(size for _, _, size in found)
        self._evict()

    def _note(self, path: str, size: int | None) -> None:
        """Record a write (size) or a read hit (None) in the index; a no-op without a capacity."""
        if self.capacity is None:
            return
        with self._lock:
            if size is None:
                if path in self._index:
                    self._index.move_to_end(path)
                return
            self._bytes += size - self._index.pop(path, 0)
            self._index[path] = size

    def _forget(self, path: str) -> None:
        if self.capacity is not None:
            with self._lock:
                self._bytes -= self._index.pop(path, 0)

    def _evict(self) -> None:
        """Remove least recently used files until the bytes held fit the capacity."""
        if self.capacity is None:
            return
        while True:
            with self._lock:
                if self._bytes <= self.capacity or not self._index:
                    return
                path, size = self._index.popitem(last=False)
                self._bytes -= size
            unlink(path)
            self.evicted += 1

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._refused is not None:  # an untrusted root stays refused: never retried into
            raise self._refused
        try:
            return await asyncio.to_thread(fn, *args)
        except OSError as exc:
            raise L2Error(f"filesystem: {exc}") from exc

    # -- operations ------------------------------------------------------------------------------
    async def put(self, items: Sequence[tuple[str, bytes]]) -> None:
        await self._run(self._put_all, list(items))

    async def put_parts(self, items: Sequence[tuple[str, BlobParts | LazyBlob]]) -> None:
        await self._run(self._put_all, list(items))

    def _put_all(self, items: list[tuple[str, bytes | BlobParts | LazyBlob]]) -> None:
        written: list[tuple[str, int]] = []
        try:
            for key, blob in items:
                parts = (blob,) if isinstance(blob, bytes) else blob_parts(blob)  # a lazy one encoded here
                if self.direct:
                    parts = frame(parts)
                path = self._file(key)
                self.writer.write(path, parts)
                written.append((path, sum(len(p) for p in parts)))
            if self.fsync:  # the names durable before the put returns: each directory once per batch
                for directory in {os.path.dirname(path) for path, _ in written}:
                    fsync_dir(directory)
        finally:
            for path, size in reversed(written):  # a batch is in chunk order: its head ends up most recent
                self._note(path, size)
        self._evict()

    async def get(self, keys: Sequence[str]) -> list[bytes | None]:
        return await self._run(self._get_all, list(keys))

    def _get_all(self, keys: list[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        paths = [self._file(key) for key in keys]
        for path in paths:
            try:
                with open(path, "rb") as fh:
                    out.append(unframe(fh.read()))
            except FileNotFoundError:
                self._forget(path)
                out.append(None)
        for path, blob in zip(reversed(paths), reversed(out), strict=True):  # head last: most recent
            if blob is not None:
                self._note(path, None)
        return out

    async def get_into(
        self, keys: Sequence[str], dests: Sequence[memoryview | None], head: int, check: Check
    ) -> list[bytes | Landed | None]:
        return await self._run(self._get_into_all, list(keys), list(dests), head, check)

    def _get_into_all(
        self, keys: list[str], dests: list[memoryview | None], head: int, check: Check
    ) -> list[bytes | Landed | None]:
        out: list[bytes | Landed | None] = []
        paths = [self._file(key) for key in keys]
        for key, path, dest in zip(keys, paths, dests, strict=True):
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                self._forget(path)
                out.append(None)
                continue
            try:
                blob = self._read_blob(fd, dest, head)
            finally:
                os.close(fd)
            if isinstance(blob, Landed) and dest is not None:
                blob = Landed(blob.head, check(key, blob.head, dest))
            out.append(blob)
        for path, got in zip(reversed(paths), reversed(out), strict=True):  # head last: most recent
            if got is not None:
                self._note(path, None)
        return out

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        return await self._run(lambda: [os.path.isfile(self._file(k)) for k in keys])

    async def delete(self, keys: Sequence[str]) -> None:
        await self._run(self._delete_all, list(keys))

    def _read_blob(self, fd: int, dest: memoryview | None, head: int) -> bytes | Landed:
        """One blob: into `dest` when the file holds `len(dest)` body bytes (plain: one preadv; framed:
        fs_direct.py), else read whole."""
        size = os.fstat(fd).st_size
        if dest is None:
            return _read_whole(fd)
        if size == head + len(dest):
            return _read_plain(fd, dest, head)
        if framed_size(size, len(dest)):
            got = self.reader.read(fd, size, dest)
            if got is not None:
                return Landed(got)
        return _read_whole(fd)

    def _delete_all(self, keys: list[str]) -> None:
        for key in keys:
            path = self._file(key)
            unlink(path)
            self._forget(path)

    async def usage(self) -> Usage:
        return await self._run(self._usage)

    def _usage(self) -> Usage:
        if self.capacity is not None:
            with self._lock:
                return Usage(len(self._index), self._bytes)
        objects = size = 0
        if not self._objects.is_dir():
            return Usage(0, 0)
        for sub in os.scandir(self._objects):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                try:
                    size += entry.stat().st_size
                    objects += 1
                except OSError:
                    pass
        return Usage(objects, size)


def _read_plain(fd: int, dest: memoryview, head: int) -> bytes | Landed:
    """A plain file of `head + len(dest)` bytes: its head, with the rest in `dest` (one preadv)."""
    start = bytearray(head)
    views, offset = [memoryview(start), dest], 0
    while views:
        got = os.preadv(fd, views, offset)
        if got == 0:  # truncated in place meanwhile: returned short, so decoding refuses it
            break
        offset += got
        while views and got >= len(views[0]):
            got -= len(views[0])
            views.pop(0)
        if views and got:
            views[0] = views[0][got:]
    return Landed(bytes(start)) if not views else bytes(start) + bytes(dest[: max(0, offset - head)])


def _read_whole(fd: int) -> bytes:
    with os.fdopen(os.dup(fd), "rb") as fh:
        return unframe(fh.read())
