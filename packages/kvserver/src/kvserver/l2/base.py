"""The L2 adapter interface: a small async, batched key -> bytes store below L1.

Adapters only move opaque, already-encoded blobs (see serde.py); they never interpret them. Every
method takes a batch so that network stores can pipeline (one round trip per batch). Any failure of
the backing store is raised as `L2Error`; the tier manager turns it into a miss or a drop and backs
off, so a store that goes away never crashes or hangs the server.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


class L2Error(Exception):
    """The backing store failed (unreachable, timed out, refused); the operation had no effect."""


@dataclass(frozen=True, slots=True)
class Usage:
    """What a tier holds, as far as the backing store can say cheaply (see each adapter)."""

    objects: int
    bytes: int


#: a blob as parts written back to back (header, body), so a body can stay in its L1 slot
BlobParts = tuple[bytes | memoryview, ...]


class LazyBlob:
    """A blob encoded when first asked for, by the thread that writes it. Encoding passes over the
    body (its checksum); right before the write that pass pulls the body into cache for the write's
    own read of it, where a batch encoded up front has left the cache by then."""

    __slots__ = ("_encode", "_parts")

    def __init__(self, encode: Callable[[], BlobParts]) -> None:
        self._encode = encode
        self._parts: BlobParts | None = None

    def parts(self) -> BlobParts:
        if self._parts is None:
            self._parts = self._encode()
        return self._parts


def blob_parts(blob: BlobParts | LazyBlob) -> BlobParts:
    return blob.parts() if isinstance(blob, LazyBlob) else blob


#: run by `get_into` on (key, head, dest) right after a blob landed, while its bytes are in cache
Check = Callable[[str, bytes, memoryview], object]


@dataclass(frozen=True, slots=True)
class Landed:
    """`get_into` found a blob of exactly `len(head) + len(dest)` bytes: `head` is its start, the
    rest is now in `dest`, and `verdict` is what the caller's check returned for it."""

    head: bytes
    verdict: object = None


class L2Adapter(abc.ABC):
    """One backing store. Keys are `ObjectKey.to_str()` strings; values are encoded blobs."""

    #: the configured URL with any password removed (safe to log and show)
    url: str
    #: `put_parts` writes the parts without joining them: the caller keeps the body's buffer (an L1
    #: slot) alive until it returns; other stores get one joined buffer
    takes_parts: bool = False

    async def start(self) -> None:
        """Connect or prepare; must not fail when the store is down (report that on first use)."""

    def describe(self) -> dict[str, Any]:
        """What this kind of store adds to its tier's entry in describe (settings, its own counters)."""
        return {}

    @abc.abstractmethod
    async def put(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Store every (key, blob); an existing key is overwritten (the same key means the same bytes)."""

    @abc.abstractmethod
    async def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """The blob of each key, or None where absent."""

    async def put_parts(self, items: Sequence[tuple[str, BlobParts | LazyBlob]]) -> None:
        """`put` of blobs given as parts; stores that can write parts back to back (`takes_parts`)
        override it to skip the join."""
        await self.put([(k, b"".join(blob_parts(blob))) for k, blob in items])

    async def get_into(
        self, keys: Sequence[str], dests: Sequence[memoryview | None], head: int, check: Check
    ) -> list[bytes | Landed | None]:
        """Like `get`, but where a store can, a blob of `head + len(dest)` bytes is read straight
        into `dest` (no intermediate copy) and `check`ed there at once (still in cache: one pass
        over memory). This default reads whole blobs."""
        return list(await self.get(keys))

    @abc.abstractmethod
    async def contains(self, keys: Sequence[str]) -> list[bool]:
        """Presence bitmap, one round trip where the store allows it."""

    @abc.abstractmethod
    async def delete(self, keys: Sequence[str]) -> None:
        """Remove the keys; absent keys are not an error."""

    @abc.abstractmethod
    async def usage(self) -> Usage:
        """Objects and bytes held (an estimate where the store cannot count cheaply)."""

    async def close(self) -> None:
        """Release connections and threads."""
