"""The control plane's transport: receive requests on the ROUTER socket, send each one's reply.

Why a reader callback and not `await recv_multipart()`: pyzmq's asyncio socket makes futures and
re-registers the descriptor for every receive and send, which cost more than the rest of a ping
(profiled: bench/profile_server.py). Here the descriptor stays registered; each wake-up drains up
to BATCH requests with non-blocking receives, answers the ones whose handlers do not wait inline
and runs the others (an L2 lookup) as tasks. Replies are sent without blocking: a ROUTER never
blocks on send (it drops at the high-water mark).

What a request means is the server's (`begin`); this module only moves frames, and runs the
after-reply work once each reply is on its way (after_reply.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, cast

import zmq

from kvprotocol._envelope import ErrorEnvelope, OkEnvelope, encode_reply

from ..service.after_reply import AfterReply

log = logging.getLogger("kvserver")
Answer = tuple[OkEnvelope | ErrorEnvelope, list[Any]]  # a reply's envelope (the reply Struct inside) and data frames
Begin = Callable[[bytes, list[memoryview]], Answer | Awaitable[Answer]]
BATCH = 64  # requests answered per wake-up before other tasks get a turn
# socket options and flags as plain ints: pyzmq's enums cost ~1 us per operation
_EVENTS, _POLLIN, _NOBLOCK, _MORE = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)


class ZmqLoop:
    """Serves `begin` (header frame, data frames -> answer) on `sock` until `run()` is cancelled."""

    def __init__(self, sock: zmq.Socket[bytes], begin: Begin, after: AfterReply) -> None:
        self._sock, self._begin, self._after = sock, begin, after
        self.answering: set[asyncio.Future[None]] = set()  # requests whose handler waits
        self._kick: Callable[[], None] = lambda: None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        sock = self._sock
        fd = cast(int, sock.getsockopt(zmq.FD))

        def on_readable() -> None:
            for _ in range(BATCH):
                if not cast(int, sock.get(_EVENTS)) & _POLLIN:  # also re-arms the edge-triggered fd
                    return
                try:  # frame by frame: recv_multipart asks RCVMORE of the socket, Frame.more is free
                    frame = sock.recv(_NOBLOCK, copy=False)
                    parts = [frame]
                    while frame.more:
                        frame = sock.recv(_NOBLOCK, copy=False)
                        parts.append(frame)
                except zmq.Again:
                    return
                self._take(parts)
            loop.call_soon(on_readable)  # more queued: let the other tasks (HTTP, expiry) run first

        def kick() -> None:
            loop.call_soon(on_readable)

        self._kick = kick
        loop.add_reader(fd, on_readable)
        loop.call_soon(on_readable)
        try:
            await loop.create_future()  # runs until cancelled
        finally:
            loop.remove_reader(fd)

    def _take(self, parts: list[zmq.Frame]) -> None:
        if len(parts) < 2:
            return  # a bare identity frame: nothing to answer to
        identity, header = parts[0], parts[1]
        out = self._begin(header.bytes, [memoryview(p.buffer) for p in parts[2:]])
        if isinstance(out, tuple):
            self._reply(identity, *out)
            self._after.run()
        else:  # a handler that waits (L2): others are answered meanwhile
            task = asyncio.ensure_future(self._reply_later(identity, out))
            self.answering.add(task)
            task.add_done_callback(self.answering.discard)

    async def _reply_later(self, identity: zmq.Frame, pending: Awaitable[Answer]) -> None:
        reply, data = await pending
        self._reply(identity, reply, data)
        self._after.run()
        self._kick()  # a send outside the reader callback may have taken the descriptor's wake-up

    def _reply(self, identity: zmq.Frame, reply: OkEnvelope | ErrorEnvelope, data: list[Any]) -> None:
        send, frames = self._sock.send, [identity, encode_reply(reply), *data]
        try:  # not send_multipart: its type checks and enum flags cost as much as a ping's handler
            for frame in frames[:-1]:
                send(frame, _MORE, copy=False)
            send(frames[-1], _NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            log.warning("could not send reply: %s", exc)
