"""Turns L1 commits, evictions and clears into KV events: one cached chunk is one block.

A chunk counts as cached ("stored") when every (rank, group) object of it is ready in L1, the same
rule lookup uses for a hit, and as gone ("removed") as soon as one of them leaves (eviction or
clear). So an event never claims more than a lookup would find.

Namespaces: a block hash is our chunk hash, which depends on the tokens (and what the engine folds
into the chain), not on the layout, world size or cache salt. The tracker therefore counts, per
(model, chunk hash), how many namespaces (layouts, world size, salt) hold the chunk: the block is
announced when the first one completes it and removed when the last one loses it. Salts and tenants
never appear in events; the model is in the topic.

Events are collected while one request is handled and sent as one batch per topic at the end of the
loop iteration (`loop.call_soon`), in the order they happened.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvprotocol import ObjectKey

from .wire import MEDIUM_L1, Event, all_blocks_cleared, block_removed, block_stored, encode_batch, external_hash

if TYPE_CHECKING:
    from kvprotocol import KeySpace

    from ..l1.cache import L1Cache
    from ..service.sessions import StoreTxn

NsChunk = tuple[str, int, tuple[str, ...], str, bytes]  # (model, world, group fingerprints, salt, chunk hash)


class EventBatcher:
    """Pending events per topic, flushed as one batch each once the current loop iteration ends."""

    def __init__(
        self, publish: Callable[[bytes, bytes], int], topic: str, hash_format: str = "bytes", host: str | None = None
    ) -> None:
        self._publish = publish
        self._topic = topic
        self._host = host or socket.gethostname()
        self.hash_format = hash_format
        self._pending: dict[bytes, list[Event]] = {}
        self._scheduled = False

    def topic_for(self, model: str) -> bytes:
        return self._topic.format(host=self._host, model=model).encode()

    def add(self, model: str, event: Event) -> None:
        events = self._pending.setdefault(self.topic_for(model), [])
        last = events[-1] if events else None
        if (
            event["type"] == "BlockRemoved"
            and last is not None
            and last["type"] == "BlockRemoved"
            and last["medium"] == event["medium"]
        ):
            last["block_hashes"].extend(event["block_hashes"])  # one removal event per run
        else:
            events.append(event)
        self._schedule()

    def _schedule(self) -> None:
        if self._scheduled:
            return
        try:
            asyncio.get_running_loop().call_soon(self.flush)
            self._scheduled = True
        except RuntimeError:  # no loop (unit use): send at once
            self.flush()

    def flush(self) -> None:
        self._scheduled = False
        pending, self._pending = self._pending, {}
        now = time.time()
        for topic, events in pending.items():
            self._publish(topic, encode_batch(now, events))


class L1EventTracker:
    """Which chunks are complete in L1, kept up to date from the cache's hooks."""

    def __init__(self, l1: L1Cache, batcher: EventBatcher, chunk_size: int, medium: str = MEDIUM_L1) -> None:
        self.l1 = l1
        self.batcher = batcher
        self.chunk_size = chunk_size
        self.medium = medium
        self._complete: dict[NsChunk, list[ObjectKey]] = {}
        self._members: dict[ObjectKey, list[NsChunk]] = {}
        self._holders: dict[tuple[str, bytes], int] = {}  # (model, chunk hash) -> namespaces holding it
        # with L2 events on: each complete chunk's tokens and parent hash, for the L2 tracker
        self.keep_info = False
        self._info: dict[NsChunk, tuple[bytes, bytes | None]] = {}

    @property
    def blocks(self) -> int:
        """Blocks currently announced as stored."""
        return len(self._holders)

    def ext(self, chunk_hash: bytes) -> bytes | int:
        return external_hash(chunk_hash, self.batcher.hash_format)

    # -- hooks -----------------------------------------------------------------------------------
    def committed(self, txn: StoreTxn) -> None:
        """After a commit: announce the chunks this commit completed (runs of adjacent chunks)."""
        if txn.keyspace is None or not txn.slots or txn.hashes is None:
            return
        full = len(txn.tokens) // 4 // self.chunk_size  # a tail (Store.tail) is no block an engine names
        chunks = sorted({slot.chunk for slot in txn.slots if slot.chunk < full})
        self._check(txn.keyspace, txn.salt, txn.tokens, txn.hashes, chunks)

    def prefetched(self, ks: KeySpace, salt: str, tokens: bytes, hashes: list[bytes], first_miss: int) -> None:
        """After an L2 prefetch: announce the chunks it completed in L1 (loads still running are not seen)."""
        self._check(ks, salt, tokens, hashes, list(range(first_miss, len(hashes))))

    def _check(self, ks: KeySpace, salt: str, tokens: bytes, hashes: list[bytes], chunks: list[int]) -> None:
        model, world, groups = ks
        announced: list[int] = []
        for chunk in chunks:
            h = hashes[chunk]
            ident: NsChunk = (model, world, groups, salt, h)
            if ident in self._complete:
                continue
            keys = [
                ObjectKey(model, fp, world, rank, g, salt, h) for rank in range(world) for g, fp in enumerate(groups)
            ]
            if any(self.l1.ready(k) is None for k in keys):
                continue  # other ranks or groups still to come
            self._complete[ident] = keys
            if self.keep_info:
                c = self.chunk_size
                self._info[ident] = (
                    bytes(tokens[chunk * c * 4 : (chunk + 1) * c * 4]),
                    hashes[chunk - 1] if chunk > 0 else None,
                )
            for k in keys:
                self._members.setdefault(k, []).append(ident)
            holders = self._holders.get((model, h), 0)
            self._holders[(model, h)] = holders + 1
            if holders == 0:
                announced.append(chunk)
        c = self.chunk_size
        for first, last in _runs(announced):
            ids = np.frombuffer(tokens, dtype="<u4", count=(last + 1 - first) * c, offset=first * c * 4)
            parent = self.ext(hashes[first - 1]) if first > 0 else None
            self.batcher.add(
                model, block_stored([self.ext(h) for h in hashes[first : last + 1]], parent, ids, c, self.medium)
            )

    def removed(self, key: ObjectKey) -> None:
        """After an object left L1 (evicted or cleared): the chunks it completed are gone."""
        idents = self._members.pop(key, None)
        if not idents:
            return
        for ident in idents:
            self._info.pop(ident, None)
            for other in self._complete.pop(ident, ()):
                members = self._members.get(other)
                if members is not None and other != key:
                    members.remove(ident)
                    if not members:
                        del self._members[other]
            model, h = ident[0], ident[4]
            holders = self._holders[(model, h)] - 1
            if holders:
                self._holders[(model, h)] = holders
            else:
                del self._holders[(model, h)]
                self.batcher.add(model, block_removed([self.ext(h)], self.medium))

    def chunks_of(self, key: ObjectKey) -> list[NsChunk]:
        """The complete chunks this object belongs to (usually one; none when its chunk is incomplete)."""
        return self._members.get(key, [])

    def keys_of(self, ident: NsChunk) -> list[ObjectKey]:
        return self._complete.get(ident, [])

    def info(self, ident: NsChunk) -> tuple[bytes, bytes | None] | None:
        """(the chunk's tokens as packed uint32, its parent's chunk hash) while kept."""
        return self._info.get(ident)

    def snapshot(self) -> dict[str, list[bytes]]:
        """Model -> chunk hashes announced as stored and not removed: what a resyncing subscriber rebuilds from."""
        out: dict[str, list[bytes]] = {}
        for model, h in self._holders:
            out.setdefault(model, []).append(h)
        return out

    def started(self) -> None:
        """A fresh server holds nothing: tell subscribers to forget what an earlier process announced."""
        self.batcher.add("", all_blocks_cleared())


def _runs(chunks: list[int]) -> list[tuple[int, int]]:
    """[0, 1, 2, 5, 6] -> [(0, 2), (5, 6)]."""
    out: list[tuple[int, int]] = []
    for c in chunks:
        if out and out[-1][1] == c - 1:
            out[-1] = (out[-1][0], c)
        else:
            out.append((c, c))
    return out
