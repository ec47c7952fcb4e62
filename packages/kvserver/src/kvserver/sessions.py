"""Read sessions (leases taken by lookup) and store transactions (reserved slots), both with TTLs.

A crashed engine never pins memory forever: an expired session gives its leases back and an expired
store transaction frees its reserved slots.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field

from .l1 import Entry, IKey

KeySpaceT = tuple[str, int, tuple[str, ...]]  # (model, world_size, group fingerprints)


@dataclass(slots=True)
class Session:
    id: str
    keyspace: KeySpaceT
    salt: str
    hashes: list[bytes]
    hit_chunks: int
    leased: list[IKey]
    expires: float


@dataclass(slots=True)
class Slot:
    key: IKey
    chunk: int
    group: int
    entry: Entry


@dataclass(slots=True)
class StoreTxn:
    id: str
    mode: str
    session: str | None
    slots: list[Slot]
    expires: float
    committed: bool = False
    # what KV events need to describe the chunks at commit (see kvevents/tracker.py)
    keyspace: KeySpaceT | None = None
    salt: str = ""
    tokens: bytes = b""
    hashes: list[bytes] | None = None


@dataclass
class SessionTable:
    lease_ttl: float
    sessions: dict[str, Session] = field(default_factory=dict)
    stores: dict[str, StoreTxn] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._ids = itertools.count(1)
        self._prefix = os.urandom(4).hex()

    def deadline(self) -> float:
        return time.monotonic() + self.lease_ttl

    def new_store_id(self) -> str:
        return f"st-{self._prefix}-{next(self._ids)}"

    def expired(self, now: float | None = None) -> tuple[list[Session], list[StoreTxn]]:
        """Remove and return sessions and store transactions past their deadline."""
        now = time.monotonic() if now is None else now
        sessions = [s for s in self.sessions.values() if s.expires <= now]
        stores = [t for t in self.stores.values() if t.expires <= now]
        for s in sessions:
            del self.sessions[s.id]
        for t in stores:
            del self.stores[t.id]
        return sessions, stores
