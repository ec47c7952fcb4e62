"""A ZMQ PUB socket and a replay ROUTER socket framed exactly like vLLM's `ZmqEventPublisher`.

- PUB: every batch is one multipart message `(topic, seq as 8-byte big-endian, payload)`, with
  sequence numbers counting up from 0 per server process. Sending never blocks the server loop: the
  socket is written with NOBLOCK and a high-water mark; a batch a slow subscriber cannot take is
  dropped by ZMQ for that subscriber (it can ask the replay socket for it) and counted here when
  ZMQ refuses it outright.
- Replay (optional, ROUTER): a client (REQ, or DEALER sending an empty delimiter frame first)
  sends the first sequence number it wants as 8 bytes big-endian; it gets the buffered batches from
  there on as `(topic, seq, payload)`, up to `replay_max_bytes` per request (always at least one
  batch; it asks again from the next seq for the rest), then the end marker
  `(b"", -1 as 8 bytes signed, b"")`. All replay answers together are paced to `replay_rate`
  bytes a second. The buffer keeps the last `buffer_batches` batches.
- With a password (the server's token, on loopback too: the stream carries every tenant's token
  ids), both sockets take ZMQ PLAIN authentication only: user "kvserver", password the token,
  checked by pyzmq's ZAP authenticator thread (started before the sockets bind). A peer without it
  never completes the handshake and receives nothing. The frames are unchanged: PLAIN is a ZMTP
  handshake mechanism, not part of vLLM's format.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging

import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator

from .pacer import BytePacer
from .wire import END_SEQ

log = logging.getLogger("kvserver.kvevents")
PLAIN_USER = "kvserver"
REPLAY_YIELD_EVERY = 256  # batches sent before a long replay lets other work on the loop run
REPLAY_FRAME_COST = 256  # bytes each replayed batch is charged beyond its own (the loop's work per message)


def _bind(sock: zmq.Socket, endpoint: str, what: str) -> None:
    """Bind, or fail with a line that names which of the server's endpoints could not be had."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise RuntimeError(f"cannot bind the {what} {endpoint}: {exc}") from None


class ZmqEventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        buffer_batches: int = 10_000,
        hwm: int = 100_000,
        password: str | None = None,
        replay_max_bytes: int = 4 << 20,
        replay_rate: float = 16 << 20,
    ) -> None:
        # A context of its own: a ZAP authenticator applies to its whole context, and the control
        # plane must not be subjected to it.
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context.shadow(self._ctx)
        self._auth: ThreadAuthenticator | None = None
        self._buffer: collections.deque[tuple[int, bytes, bytes]] = collections.deque(maxlen=buffer_batches)
        self._next_seq = 0
        self.published = 0  # batches handed to the PUB socket
        self.refused = 0  # batches ZMQ refused to queue at once (counted, never waited for)
        self.replays = 0  # replay requests served
        self.bad_replays = 0  # malformed replay requests (ignored, as vLLM does)
        self.replays_cut = 0  # replay answers that stopped at replay_max_bytes
        self.replay_bytes = 0  # payload and topic bytes replayed
        self._replay_max_bytes = replay_max_bytes
        self._pacer = BytePacer(replay_rate)
        self._replay_task: asyncio.Task[None] | None = None
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = self._actx.socket(zmq.ROUTER) if replay_endpoint else None
        try:
            if password is not None:  # before any bind
                self._auth = ThreadAuthenticator(self._ctx)
                self._auth.start()
                self._auth.configure_plain(domain="kv-events", passwords={PLAIN_USER: password})
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._secure(self._pub, password)
            self._pub.setsockopt(zmq.IPV6, int("[" in endpoint))  # tcp://[::1]:5557 needs it
            _bind(self._pub, endpoint, "KV events endpoint")
            if self._replay is not None and replay_endpoint:
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.MAXMSGSIZE, 1024)  # a request is 8 bytes
                self._secure(self._replay, password)
                self._replay.setsockopt(zmq.IPV6, int("[" in replay_endpoint))
                _bind(self._replay, replay_endpoint, "KV events replay endpoint")
        except Exception:
            self.close()
            raise

    @staticmethod
    def _secure(sock: zmq.Socket, password: str | None) -> None:
        if password is not None:
            sock.plain_server = True
            sock.zap_domain = b"kv-events"

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start serving replay requests on the running loop."""
        if self._replay is not None:
            self._replay_task = asyncio.create_task(self._serve_replay(), name="kv-events-replay")

    async def stop(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            await asyncio.gather(self._replay_task, return_exceptions=True)
            self._replay_task = None

    def close(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)  # a shadow context's socket: term() would wait for it
        if self._auth is not None:
            with contextlib.suppress(Exception):
                self._auth.stop()
            self._auth = None
        self._ctx.term()

    # -- publishing ------------------------------------------------------------------------------
    @property
    def next_seq(self) -> int:
        return self._next_seq

    def publish(self, topic: bytes, payload: bytes) -> int:
        """Send one batch now (never blocks) and keep it for replay; returns its sequence number."""
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        try:
            self._pub.send_multipart([topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
            self.published += 1
        except zmq.ZMQError:  # Again at the high-water mark; anything else must not reach the server loop
            self.refused += 1
        self._buffer.append((seq, topic, payload))
        return seq

    # -- replay ----------------------------------------------------------------------------------
    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = await self._replay.recv_multipart()
                await self._answer_replay(frames)
            except asyncio.CancelledError:
                raise
            except Exception:  # the replay server must never die silently
                log.exception("kv-events replay request failed")

    async def _answer_replay(self, frames: list[bytes]) -> None:
        assert self._replay is not None
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self.bad_replays += 1
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        self.replays += 1
        first = self._buffer[0][0] if self._buffer else 0
        skip = min(max(0, start - first), len(self._buffer))
        sent = 0
        for i, (seq, topic, payload) in enumerate(itertools.islice(list(self._buffer), skip, None)):
            size = len(topic) + len(payload)
            if sent and sent + size > self._replay_max_bytes:  # the client asks again from seq
                self.replays_cut += 1
                break
            await self._pacer.spend(size + REPLAY_FRAME_COST)
            await self._replay.send_multipart([client, b"", topic, seq.to_bytes(8, "big"), payload])
            sent += size
            self.replay_bytes += size
            if i % REPLAY_YIELD_EVERY == REPLAY_YIELD_EVERY - 1:
                await asyncio.sleep(0)
        await self._replay.send_multipart([client, b"", b"", END_SEQ, b""])

    def describe(self) -> dict[str, float]:
        return {
            "next_seq": self.next_seq,
            "published": self.published,
            "refused": self.refused,
            "buffered": len(self._buffer),
            "replays": self.replays,
            "bad_replays": self.bad_replays,
            "replays_cut": self.replays_cut,
            "replay_bytes": self.replay_bytes,
            "replay_paced_s": round(self._pacer.waited, 3),
        }
