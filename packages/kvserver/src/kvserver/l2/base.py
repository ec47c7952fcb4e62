"""The L2 adapter interface: a small async, batched key -> bytes store below L1.

Adapters only move opaque, already-encoded blobs (see serde.py); they never interpret them. Every
method takes a batch so that network stores can pipeline (one round trip per batch). Any failure of
the backing store is raised as `L2Error`; the tier manager turns it into a miss or a drop and backs
off, so a store that goes away never crashes or hangs the server.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass


class L2Error(Exception):
    """The backing store failed (unreachable, timed out, refused); the operation had no effect."""


@dataclass(frozen=True, slots=True)
class Usage:
    """What a tier holds, as far as the backing store can say cheaply (see each adapter)."""

    objects: int
    bytes: int


class L2Adapter(abc.ABC):
    """One backing store. Keys are `ObjectKey.to_str()` strings; values are encoded blobs."""

    #: the configured URL with any password removed (safe to log and show)
    url: str

    async def start(self) -> None:
        """Connect or prepare; must not fail when the store is down (report that on first use)."""

    @abc.abstractmethod
    async def put(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Store every (key, blob); an existing key is overwritten (the same key means the same bytes)."""

    @abc.abstractmethod
    async def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """The blob of each key, or None where absent."""

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
