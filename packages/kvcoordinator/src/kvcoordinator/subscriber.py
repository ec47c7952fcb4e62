"""Feeds the prefix index from each instance's KV-events stream, and keeps it honest.

One SUB socket per instance that advertised KV events at registration (the coordinator connects
out, so only endpoints a credentialed registration named can ever feed the index). The socket
presents the instance token with ZMQ PLAIN, as kvserver requires on every endpoint, only where the
fan-out would send it (credentials.py: a bound socket of this user, or a --trust-host host). Per
instance:

- the stream's sequence numbers must follow each other. Anything else (a gap from a slow join or
  a high-water-mark drop, a batch out of order, a payload that does not decode, a topic or hash of
  the wrong shape) drops everything the instance claimed and **resyncs**: the instance's
  `GET /v1/kv-events/snapshot` replaces its entries and the stream goes on from the snapshot's
  `next_seq`. So a wrong claim lasts at most until the next resync;
- the first snapshot waits for the socket's handshake with the instance's publisher: a snapshot
  taken before the subscription is up would miss the batches sent meanwhile, and if nothing follows
  them no gap would ever show it (ZMQ's slow joiner). A feed whose publisher cannot be reached or
  refuses the token stays out of sync;
- seq 0 starting with AllBlocksCleared is a new server process on the same endpoint: its entries
  are dropped and the stream applied from there;
- heartbeats carry the instance's `kv_events_seq`; a feed still short of the sequence number one
  heartbeat announced when the next heartbeat arrives has lost the tail of the stream (nothing
  newer came to show the gap) and resyncs;
- while an instance is not in sync it is not answered from the index: fleet lookups ask it
  directly (fan-out), as they do for instances without events.

Only the `kvserver_l1` medium is indexed: what an instance's `/v1/query` counts as a hit.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import msgpack
import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from .credentials import InstanceCredentials
from .index import PrefixIndex
from .registry import MAX_INSTANCES, Instance

log = logging.getLogger("kvcoordinator.events")
MEDIUM = "kvserver_l1"
PLAIN_USER = b"kvserver"
RCVHWM = 100_000
LAG_SAMPLES = 4096
MAX_BACKOFF = 5.0
DRAIN_MAX = 1000  # batches taken from one socket per loop callback


class Resync(Exception):
    """The stream cannot be applied as it is: drop the instance's entries and resync."""


@dataclass
class Feed:
    inst: Instance
    slot: int
    prefix: str  # topic before the model
    sock: zmq.Socket
    expected: int | None = None  # next seq to apply; None while not in sync
    announced_seq: int | None = None  # kv_events_seq of the last heartbeat
    resync: asyncio.Task[None] | None = None  # while set, the stream waits in the socket (not read)
    monitor: zmq.Socket | None = None  # the socket's handshake events, until the first one succeeds
    connected: asyncio.Future[None] | None = None  # set once the first handshake succeeded
    reason: str = "initial sync"


def topic_prefix(template: str) -> str | None:
    """`kv@node1@{model}` -> `kv@node1@`; None when the model is not the topic's tail (cannot index)."""
    if not template.endswith("{model}") or template.count("{model}") != 1:
        return None
    return template[: -len("{model}")]


class EventFeeds:
    """The SUB sockets, per-instance sync state and counters; the index they feed."""

    def __init__(
        self,
        index: PrefixIndex,
        creds: InstanceCredentials,
        client: Callable[[], httpx.AsyncClient],
        timeout: float = 2.0,
    ) -> None:
        self.index = index
        self.creds = creds
        self.client = client
        self.timeout = timeout
        self.ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, 3 * MAX_INSTANCES + 64)  # a SUB per instance, a monitor pair until its handshake
        self.feeds: dict[str, Feed] = {}
        self.by_slot: dict[int, Feed] = {}
        self.in_sync = 0  # feeds whose expected seq is known
        self._synced_slots: dict[int, int] = {}  # chunk size -> bitmap of the slots of feeds in sync
        self._chunk_sizes: collections.Counter[int] = collections.Counter()
        self._free: list[int] = []
        self._next_slot = 0
        self.lags: collections.deque[float] = collections.deque(maxlen=LAG_SAMPLES)
        self.counts = {
            "batches": 0,
            "events": 0,
            "resyncs": 0,
            "resync_failures": 0,
            "gaps": 0,
            "bad": 0,
            "restarts": 0,
            "tail_losses": 0,
        }

    # -- membership ------------------------------------------------------------------------------
    def add(self, inst: Instance) -> None:
        ad = inst.kv_events
        prefix = topic_prefix(ad.topic) if ad is not None else None
        if ad is None or prefix is None or not inst.http_url or not inst.chunk_size:
            if ad is not None:
                log.warning(
                    "instance %s: KV events not indexable (topic %r must end in {model}, http url and "
                    "chunk size needed); its lookups use fan-out",
                    inst.id,
                    ad.topic,
                )
            return
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
        token = self.creds.token_for_events(ad.endpoint)
        if token is not None:  # kvserver's event sockets take its token as PLAIN, on loopback too
            sock.plain_username, sock.plain_password = PLAIN_USER, token.encode()
        sock.setsockopt(zmq.IPV6, int("[" in ad.endpoint))
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sock.connect(ad.endpoint)
        slot = self._free.pop() if self._free else self._alloc()
        loop = asyncio.get_running_loop()
        feed = Feed(inst, slot, prefix, sock, monitor=monitor, connected=loop.create_future())
        self.feeds[inst.id] = feed
        self.by_slot[slot] = feed
        self._chunk_sizes[inst.chunk_size] += 1
        loop.add_reader(int(sock.getsockopt(zmq.FD)), self._readable, feed)
        loop.add_reader(int(monitor.getsockopt(zmq.FD)), self._monitor_readable, feed)
        loop.call_soon(self._monitor_readable, feed)  # what the monitor queued before its FD was watched
        self._resync_soon(feed, "initial sync")

    def _alloc(self) -> int:
        self._next_slot += 1
        return self._next_slot - 1

    def drop(self, inst: Instance) -> None:
        feed = self.feeds.pop(inst.id, None)
        if feed is None:
            return
        if feed.resync is not None:
            feed.resync.cancel()
        asyncio.get_running_loop().remove_reader(int(feed.sock.getsockopt(zmq.FD)))
        self._unmonitor(feed)
        feed.sock.close(linger=0)
        self._mark(feed, None)
        self.index.clear(feed.slot)
        del self.by_slot[feed.slot]
        self._chunk_sizes[int(feed.inst.chunk_size or 0)] -= 1
        if self._chunk_sizes[int(feed.inst.chunk_size or 0)] <= 0:
            del self._chunk_sizes[int(feed.inst.chunk_size or 0)]
        self._free.append(feed.slot)

    def heartbeat(self, inst: Instance, seq: int | None) -> None:
        """A heartbeat's kv_events_seq: if the previous one is still ahead of the feed, the tail was lost."""
        feed = self.feeds.get(inst.id)
        if feed is None or seq is None:
            return
        if feed.expected is not None and feed.announced_seq is not None and feed.expected < feed.announced_seq:
            self.counts["tail_losses"] += 1
            self._resync_soon(feed, f"stream stopped at seq {feed.expected}, heartbeat said {feed.announced_seq}")
        feed.announced_seq = seq

    def _resync_soon(self, feed: Feed, why: str) -> None:
        """Drop the instance's claims now and resync it in the background (the stream waits meanwhile)."""
        self.index.clear(feed.slot)
        self._mark(feed, None)
        feed.reason = why
        if feed.resync is None:
            feed.resync = asyncio.get_running_loop().create_task(
                self._resync_until_done(feed), name=f"kv-events-resync-{feed.inst.id}"
            )

    def _mark(self, feed: Feed, expected: int | None) -> None:
        """Set the next seq to apply (None: out of sync), keeping the count of feeds in sync."""
        self.in_sync += (expected is not None) - (feed.expected is not None)
        feed.expected = expected
        size, bit = int(feed.inst.chunk_size or 0), 1 << feed.slot
        bits = self._synced_slots.get(size, 0)
        self._synced_slots[size] = bits | bit if expected is not None else bits & ~bit

    def chunk_sizes(self) -> list[int]:
        """The chunk sizes of the instances fed (usually one: a fleet shares its chunk size)."""
        return list(self._chunk_sizes)

    def synced_slots(self, chunk_size: int) -> int:
        """Bitmap of the slots in sync with this chunk size: what a lookup may answer from the index."""
        return self._synced_slots.get(chunk_size, 0)

    def synced(self, inst_id: str) -> Feed | None:
        feed = self.feeds.get(inst_id)
        return feed if feed is not None and feed.expected is not None else None

    async def close(self) -> None:
        for feed in list(self.feeds.values()):
            self.drop(feed.inst)
        self.ctx.destroy(linger=0)

    # -- the stream ------------------------------------------------------------------------------
    def _readable(self, feed: Feed) -> None:
        """The socket's FD signalled: apply what is queued, with no task or future per batch.

        A ZMQ socket's FD is edge-triggered: after draining, the socket's EVENTS must be read
        (which re-arms it), and if a batch is still waiting (the drain is bounded so that one busy
        instance cannot starve the loop), the drain is scheduled again.
        """
        if feed.sock.closed:
            return
        if feed.resync is not None:  # the stream waits in the socket until the resync ends; reading
            feed.sock.getsockopt(zmq.EVENTS)  # EVENTS settles the FD, so the loop does not spin on it
            return
        try:
            self._drain(feed)
            more = bool(int(feed.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)
        except Exception:  # a reader callback must never die silently
            log.exception("KV events feed of %s failed; resyncing", feed.inst.id)
            self._resync_soon(feed, "feed error")
            return
        if more and feed.resync is None:
            asyncio.get_running_loop().call_soon(self._readable, feed)

    def _drain(self, feed: Feed) -> int:
        """Apply what is queued on one socket (bounded, so one busy instance cannot starve the loop)."""
        n = 0
        while n < DRAIN_MAX and feed.resync is None:
            try:
                frames = feed.sock.recv_multipart(flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            n += 1
            try:
                self._apply(feed, frames)
            except Resync as exc:
                self._resync_soon(feed, str(exc))
        return n

    async def _connected(self, feed: Feed) -> None:
        """Return once the socket has completed a handshake with the publisher."""
        if feed.connected is not None:
            await asyncio.shield(feed.connected)

    def _monitor_readable(self, feed: Feed) -> None:
        """The monitor's FD signalled (edge-triggered, like the stream's): read its events until none
        is left; the first successful handshake ends the monitoring. No polling while a publisher
        cannot be reached, however many such instances there are."""
        while feed.monitor is not None:
            try:
                event = recv_monitor_message(feed.monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                if not int(feed.monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:  # reading EVENTS re-arms the FD
                    return
                continue
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._unmonitor(feed)
                if feed.connected is not None and not feed.connected.done():
                    feed.connected.set_result(None)

    def _unmonitor(self, feed: Feed) -> None:
        """Stop watching handshakes: the reader goes before the socket closes (a closed FD's number
        may be reused by the next instance's socket)."""
        if feed.monitor is not None:
            asyncio.get_running_loop().remove_reader(int(feed.monitor.getsockopt(zmq.FD)))
            feed.sock.disable_monitor()
            feed.monitor.close(linger=0)
            feed.monitor = None

    async def _resync_until_done(self, feed: Feed) -> None:
        backoff = 0.1
        try:
            await self._connected(feed)
            while not await self._resync(feed):
                await asyncio.sleep(backoff)
                backoff = min(MAX_BACKOFF, backoff * 2)
        finally:
            feed.resync = None
        asyncio.get_running_loop().call_soon(self._readable, feed)  # what queued meanwhile

    def _apply(self, feed: Feed, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.counts["bad"] += 1
            raise Resync("malformed message")
        seq = int.from_bytes(frames[1], "big")
        try:
            batch = msgpack.unpackb(frames[2], raw=False, strict_map_key=True)
            ts, events = batch[0], batch[1]
            if not isinstance(events, list) or not isinstance(ts, (int, float)):
                raise ValueError("batch shape")
        except Exception:
            self.counts["bad"] += 1
            raise Resync(f"undecodable batch at seq {seq}") from None
        restart = (
            seq == 0 and bool(events) and isinstance(events[0], dict) and events[0].get("type") == "AllBlocksCleared"
        )
        if restart:
            if feed.expected not in (None, 0):
                self.counts["restarts"] += 1
            self.index.clear(feed.slot)
            self._mark(feed, 0)
        if feed.expected is None or seq < feed.expected:
            return  # not in sync yet, or already in the snapshot
        if seq > feed.expected:
            self.counts["gaps"] += 1
            raise Resync(f"gap: expected seq {feed.expected}, got {seq}")
        topic = frames[0].decode(errors="replace")
        model = topic[len(feed.prefix) :] if topic.startswith(feed.prefix) else None
        self._events(feed, model, events, seq)
        self._mark(feed, seq + 1)
        self.counts["batches"] += 1
        self.lags.append(time.time() - float(ts))

    def _events(self, feed: Feed, model: str | None, events: list[Any], seq: int) -> None:
        index, slot = self.index, feed.slot
        for ev in events:
            kind = ev.get("type") if isinstance(ev, dict) else None
            self.counts["events"] += 1
            if kind == "AllBlocksCleared":
                index.clear(slot)
                continue
            if kind not in ("BlockStored", "BlockRemoved"):
                self.counts["bad"] += 1
                raise Resync(f"unknown event at seq {seq}")
            if ev.get("medium") != MEDIUM:
                continue
            hashes = ev.get("block_hashes")
            if (
                model is None
                or not model
                or not isinstance(hashes, list)
                or not all(isinstance(h, (bytes, int)) and not isinstance(h, bool) for h in hashes)
            ):
                self.counts["bad"] += 1
                raise Resync(f"bad {kind} at seq {seq}")
            keys = index.keys(model, hashes)
            if kind == "BlockStored":
                if ev.get("block_size") != feed.inst.chunk_size:
                    self.counts["bad"] += 1
                    raise Resync(f"block size {ev.get('block_size')!r} is not the chunk size")
                index.add(slot, keys)
            else:
                index.remove(slot, keys)

    async def _resync(self, feed: Feed) -> bool:
        """Replace the instance's entries with its snapshot; False (and stay out of sync) when that fails."""
        self.index.clear(feed.slot)
        self._mark(feed, None)
        url = f"{feed.inst.http_url.rstrip('/')}/v1/kv-events/snapshot"  # type: ignore[union-attr]
        try:
            reply = await self.client().get(
                url, timeout=self.timeout, headers=self.creds.headers_for(feed.inst.http_url or "")
            )
            reply.raise_for_status()
            snap = reply.json()
            next_seq = snap["next_seq"]
            if not isinstance(next_seq, int) or next_seq < 0 or snap.get("chunk_size") != feed.inst.chunk_size:
                raise ValueError("snapshot has no next_seq, or another chunk size")
            keys: list[int] = []
            for model, packed in dict(snap["models"]).items():
                arr = np.frombuffer(base64.b64decode(packed, validate=True), dtype="<u8")
                keys.extend((arr ^ np.uint64(self.index.tag(str(model)))).tolist())
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.counts["resync_failures"] += 1
            if self.counts["resync_failures"] <= 10 or self.counts["resync_failures"] % 1000 == 0:
                log.warning(
                    "instance %s: KV events resync failed (%s: %s); lookups fan out to it meanwhile",
                    feed.inst.id,
                    type(exc).__name__,
                    str(exc)[:200],
                )
            return False
        self.index.add(feed.slot, keys)
        self._mark(feed, next_seq)
        self.counts["resyncs"] += 1
        log.info(
            "instance %s: index resynced (%s): %d chunks, stream from seq %d",
            feed.inst.id,
            feed.reason,
            len(keys),
            next_seq,
        )
        return True

    def describe(self) -> dict[str, Any]:
        lags = sorted(self.lags)
        return {
            "feeds": len(self.feeds),
            "synced": self.in_sync,
            **self.counts,
            "lag_p50_ms": round(lags[len(lags) // 2] * 1e3, 3) if lags else None,
            "lag_p99_ms": round(lags[min(len(lags) - 1, int(0.99 * len(lags)))] * 1e3, 3) if lags else None,
        }
