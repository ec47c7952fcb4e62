"""ZMQ clients (DEALER): a sync one for simple callers and an asyncio one with many requests in flight.

Every call has a timeout and raises `RequestTimeout` instead of hanging; replies that arrive after
their request timed out are recognised by id and dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from ._credentials import resolve_server_key, resolve_token
from ._envelope import ReplyHead, decode_head
from ._errors import KVProtocolError, RequestTimeout, ServerError
from ._messages import PROTOCOL_VERSION, pack
from ._replies import decode_reply
from ._requests import R, Request
from ._typed import TypedOps, new_session_id

Buffer = bytes | bytearray | memoryview
DEFAULT_TIMEOUT = 5.0
_NOBLOCK, _MORE, _RCVTIMEO = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE), int(zmq.RCVTIMEO)


@dataclass(slots=True)
class Reply:
    """A successful reply: the result map and any data frames (tcp mode object bytes)."""

    result: Any
    frames: list[memoryview] = field(default_factory=list)


@dataclass(slots=True)
class _Raw:
    """A successful reply before its result is decoded: by `send` into its reply Struct, by `call` into a map."""

    result: msgspec.Raw
    frames: list[memoryview]

    def untyped(self) -> Reply:
        return Reply(msgspec.msgpack.decode(self.result), self.frames)


def _configure(sock: zmq.Socket, server_key: bytes | None) -> None:
    if server_key is not None:  # CURVE: encrypted, and only the holder of the server's secret key answers
        public, secret = zmq.curve_keypair()
        sock.curve_serverkey = server_key
        sock.curve_publickey = public
        sock.curve_secretkey = secret
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 6000)


def _envelope(rid: int, op: str, fields: dict[str, Any], token: str | None) -> bytes:
    head: dict[str, Any] = {"v": PROTOCOL_VERSION, "id": rid, "op": op}
    if token:
        head["auth"] = token
    return pack({**head, **fields})


_ENCODER = msgspec.msgpack.Encoder()


def _encode(req: Request, rid: int, token: str | None) -> bytes:
    """A typed request as its header frame: the envelope (version, id, token) is filled in here."""
    req.v, req.id, req.auth = PROTOCOL_VERSION, rid, token or None
    return _ENCODER.encode(req)


def _typed(req: Request[R], reply: _Raw) -> tuple[R, list[memoryview]]:
    try:
        return decode_reply(req, reply.result), reply.frames
    except msgspec.DecodeError as exc:  # ValidationError included: a missing or mistyped field
        raise KVProtocolError(f"{req.op_name()}: malformed reply from server: {exc}") from exc


def _token(token: str | None, url: str) -> str | None:
    """The API token (see _credentials.resolve_token); the server needs it on every op but ping."""
    return resolve_token(token, url)


def _parse(parts: Sequence[zmq.Frame]) -> tuple[int, ReplyHead]:
    """The reply's id and envelope; its result stays raw until the caller knows its Struct."""
    head = decode_head(parts[0].bytes)
    return head.rid, head


def _to_reply(head: ReplyHead, parts: Sequence[zmq.Frame]) -> _Raw:
    if head.ok is True:
        return _Raw(head.result, [memoryview(p.buffer) for p in parts[1:]])
    err = head.error if isinstance(head.error, dict) else {}
    raise ServerError(str(err.get("code", "INTERNAL")), str(err.get("message", "no message")))


def _start_id() -> int:
    return (os.getpid() << 20) ^ int(time.monotonic_ns() & 0xFFFFF)


class Client(TypedOps):
    """Blocking client; thread-safe (one request at a time per client).

    One typed method per op (`c.lookup(keyspace=..., tokens=...)` -> LookupReply; see _typed.py),
    `send(request)` for a request built elsewhere, and the untyped `call(op, **fields)`.
    """

    new_session = staticmethod(new_session_id)

    def __init__(
        self,
        url: str,
        timeout: float = DEFAULT_TIMEOUT,
        context: zmq.Context | None = None,
        token: str | None = None,
        server_key: str | None = None,
    ) -> None:
        self.url = url
        self.timeout = timeout
        self._token = _token(token, url)
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        _configure(self._sock, resolve_server_key(server_key))
        self._sock.connect(url)
        self._ids = itertools.count(_start_id() & 0xFFFFFFFFFFFF)
        self._lock = threading.Lock()

    def call(self, op: str, frames: Sequence[Buffer] = (), timeout: float | None = None, **fields: object) -> Reply:
        """Send one untyped request (a map of fields) and wait for its reply; raises ServerError, RequestTimeout."""
        return self._roundtrip(op, lambda rid: _envelope(rid, op, fields, self._token), frames, timeout).untyped()

    def send(
        self, req: Request[R], frames: Sequence[Buffer] = (), timeout: float | None = None
    ) -> tuple[R, list[memoryview]]:
        """Send one typed request; returns its reply Struct (kvprotocol._replies: `Lookup` -> `LookupReply`)
        and any data frames."""
        reply = self._roundtrip(req.op_name(), lambda rid: _encode(req, rid, self._token), frames, timeout)
        return _typed(req, reply)

    def _op(self, req: Request, frames: Sequence[Buffer], timeout: float | None, with_frames: bool) -> Any:
        reply, data = self.send(req, frames, timeout)
        return (reply, data) if with_frames else reply

    def _roundtrip(self, op: str, header: Any, frames: Sequence[Buffer], timeout: float | None) -> _Raw:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._lock:
            rid = next(self._ids)
            # frame by frame, with plain int flags and a receive timeout rather than a Poller: pyzmq's
            # send_multipart, recv_multipart and poll cost ~10 us of Python per round trip (a ping's
            # client side is ~45 us of CPU in all on a 2-vCPU VM; bench/server.py)
            sock = self._sock
            try:
                sock.send(header(rid), _MORE if frames else _NOBLOCK, copy=False)
                for i, frame in enumerate(frames, 1):
                    sock.send(frame, _MORE if i < len(frames) else _NOBLOCK, copy=False)
            except zmq.Again as exc:
                raise RequestTimeout(f"{op}: cannot queue request to {self.url}") from exc
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RequestTimeout(f"{op}: no reply from {self.url} within the timeout")
                sock.set(_RCVTIMEO, int(remaining * 1000) + 1)
                try:
                    part = sock.recv(0, copy=False)
                    parts = [part]
                    while part.more:
                        part = sock.recv(0, copy=False)
                        parts.append(part)
                except zmq.Again:
                    raise RequestTimeout(f"{op}: no reply from {self.url} within the timeout") from None
                got, header = _parse(parts)
                if got == rid:
                    return _to_reply(header, parts)

    def close(self) -> None:
        self._sock.close(linger=0)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(TypedOps):
    """asyncio client: many requests in flight on one DEALER socket, matched to replies by id.

    The same typed methods as `Client` (_typed.py), each returning an awaitable of its reply.
    """

    new_session = staticmethod(new_session_id)

    def __init__(
        self, url: str, timeout: float = DEFAULT_TIMEOUT, token: str | None = None, server_key: str | None = None
    ) -> None:
        self.url = url
        self.timeout = timeout
        self._token = _token(token, url)
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        _configure(self._sock, resolve_server_key(server_key))
        self._sock.connect(url)
        self._ids = itertools.count(_start_id() & 0xFFFFFFFFFFFF)
        self._pending: dict[int, asyncio.Future[_Raw]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def call(
        self, op: str, frames: Sequence[Buffer] = (), timeout: float | None = None, **fields: object
    ) -> Reply:
        raw = await self._roundtrip(op, lambda rid: _envelope(rid, op, fields, self._token), frames, timeout)
        return raw.untyped()

    async def send(
        self, req: Request[R], frames: Sequence[Buffer] = (), timeout: float | None = None
    ) -> tuple[R, list[memoryview]]:
        """Send one typed request; returns its reply Struct (kvprotocol._replies) and any data frames."""
        reply = await self._roundtrip(req.op_name(), lambda rid: _encode(req, rid, self._token), frames, timeout)
        return _typed(req, reply)

    async def _op(self, req: Request, frames: Sequence[Buffer], timeout: float | None, with_frames: bool) -> Any:
        reply, data = await self.send(req, frames, timeout)
        return (reply, data) if with_frames else reply

    async def _roundtrip(self, op: str, header: Any, frames: Sequence[Buffer], timeout: float | None) -> _Raw:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())
        rid = next(self._ids)
        fut: asyncio.Future[_Raw] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            await self._sock.send_multipart([header(rid), *frames], copy=False)
            return await asyncio.wait_for(fut, self.timeout if timeout is None else timeout)
        except TimeoutError as exc:
            raise RequestTimeout(f"{op}: no reply from {self.url} within the timeout") from exc
        finally:
            self._pending.pop(rid, None)

    async def _read_loop(self) -> None:
        while True:
            parts = await self._sock.recv_multipart(copy=False)
            try:
                rid, header = _parse(parts)
                fut = self._pending.get(rid)
                if fut is None or fut.done():
                    continue
                try:
                    fut.set_result(_to_reply(header, parts))
                except ServerError as exc:
                    fut.set_exception(exc)
            except KVProtocolError:
                continue

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._sock.close(linger=0)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
