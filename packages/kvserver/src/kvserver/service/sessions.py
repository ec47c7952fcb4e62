"""Read sessions (leases taken by lookup, held per reader rank) and store transactions, both with TTLs.

A crashed engine never pins memory forever: an expired session gives its leases back and an expired
store transaction frees its reserved slots (after a quarantine, see cache.py).

Why leases are per reader: with tensor parallelism every rank of an engine loads its own objects of
the same session, at its own pace. A session therefore holds one `Reader` per rank, each with its
own lease set; a rank's release returns only its leases, and the session ends when every reader
has released (or on expiry, a rank-less release, or end_session). Each reader incarnation gets a
server-unique `lease` number: retrieve hands it out, and release reports whether the reader that
holds that number still held its leases. A reader whose leases were dropped (expiry, a replacing
lookup, someone else's release) can never see its number again, so a copy made under it is known
to be unsafe even if a new reader for the same rank exists by then.
"""

from __future__ import annotations

import itertools
import secrets
import time
from dataclasses import dataclass, field

from kvprotocol import KeySpace, ObjectKey

from ..l1.cache import Entry

_lease_numbers = itertools.count(1)  # never repeats within a server process


@dataclass(slots=True)
class Reader:
    """One rank's hold on the hit prefix of a lookup: exactly these keys are leased for it."""

    keyspace: KeySpace
    salt: str
    hashes: list[bytes]
    hit_chunks: int
    keys: list[ObjectKey]
    lease: int = field(default_factory=lambda: next(_lease_numbers))
    tenant: str = "default"  # whose share of the session-object budget it is charged to

    @property
    def charge(self) -> int:
        """What it counts against the session-object budget: its chunk hashes and leased keys."""
        return len(self.hashes) + len(self.keys)


@dataclass(slots=True)
class Session:
    id: str
    readers: dict[int, Reader]  # rank -> its lease set
    expires: float


@dataclass(slots=True)
class Slot:
    key: ObjectKey
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
    # what KV events need to describe the chunks at commit (see kvevents/tracker.py)
    keyspace: KeySpace | None = None
    salt: str = ""
    tokens: bytes = b""
    hashes: list[bytes] | None = None
    owner: str = "default"  # the tenant that reserved it: nobody else can commit or abort it
    kind: str = "prefix"  # "blend": a content-keyed chunk (blend_index.py), counted apart from prefix stores
    reservation: str | None = None  # the whole-request reservation it draws on (reservations.py)


def new_store_id() -> str:
    """128 random bits: a store id can be neither guessed nor enumerated by another client."""
    return "st-" + secrets.token_hex(16)


@dataclass
class SessionTable:
    lease_ttl: float
    sessions: dict[str, Session] = field(default_factory=dict)
    stores: dict[str, StoreTxn] = field(default_factory=dict)

    def deadline(self) -> float:
        return time.monotonic() + self.lease_ttl

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
