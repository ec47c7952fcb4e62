"""A client that never blocks longer than its caller allows: many requests in flight on one socket.

Why: an engine's scheduler asks the server about every new request inside its step loop; while it
waits, no request of that engine runs. On a busy host a round trip that takes 0.3 ms when the host
is idle took 10 ms on average here, and sometimes 100 ms. `submit` queues a request and returns its
id at once; `result(rid, wait)` hands back the typed reply once it arrived, waiting at most `wait`
seconds, and None before, so a slow answer is collected on a later call instead. Requests on one
Pipeline reach the server in submission order (one DEALER socket), so a release submitted before a
lookup of the same session is processed before it. Not thread-safe: one owner.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence

import zmq

from ._client import Buffer, _configure, _encode, _parse, _start_id, _to_reply, _token, _typed
from ._credentials import resolve_server_key
from ._envelope import ReplyHead
from ._errors import KVProtocolError, RequestTimeout
from ._replies import Reply_
from ._requests import Request

MAX_IN_FLIGHT = 4096  # requests awaiting a reply; past this, submit refuses (the server is not answering)


class Pipeline:
    def __init__(
        self, url: str, token: str | None = None, server_key: str | None = None, context: zmq.Context | None = None
    ) -> None:
        self.url = url
        self._token = _token(token, url)
        self._sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
        _configure(self._sock, resolve_server_key(server_key))
        self._sock.connect(url)
        self._ids = itertools.count(_start_id() & 0xFFFFFFFFFFFF)
        self._waiting: dict[int, Request | None] = {}  # rid -> its request (None: reply not wanted)
        self._arrived: dict[int, tuple[ReplyHead, list[zmq.Frame]]] = {}  # envelope read once, result raw

    def submit(self, req: Request, frames: Sequence[Buffer] = (), want_reply: bool = True) -> int:
        """Queue one request; returns its id. `want_reply=False`: fire and forget (the reply is dropped).

        Raises RequestTimeout when the request cannot even be queued (the server has not answered
        MAX_IN_FLIGHT requests, or ZMQ's send queue is full)."""
        self._drain(0)
        if len(self._waiting) >= MAX_IN_FLIGHT:
            raise RequestTimeout(f"{req.op_name()}: {MAX_IN_FLIGHT} requests to {self.url} await a reply")
        rid = next(self._ids)
        try:
            self._sock.send_multipart([_encode(req, rid, self._token), *frames], copy=False, flags=zmq.NOBLOCK)
        except zmq.Again as exc:
            raise RequestTimeout(f"{req.op_name()}: cannot queue request to {self.url}") from exc
        self._waiting[rid] = req if want_reply else None
        return rid

    def result(self, rid: int, wait: float = 0.0) -> tuple[Reply_, list[memoryview]] | None:
        """The typed reply of request `rid` once it arrived (waiting at most `wait` seconds), else None.

        Raises ServerError for an error reply, KeyError for an id that is not awaited (unknown,
        forgotten, or its result already taken)."""
        req = self._waiting[rid]
        if req is None:
            raise KeyError(rid)
        deadline = time.monotonic() + wait
        while rid not in self._arrived:
            remaining = deadline - time.monotonic()
            if remaining <= 0 and not self._drain(0):
                return None
            if remaining > 0:
                self._drain(remaining)
        head, parts = self._arrived.pop(rid)
        del self._waiting[rid]
        return _typed(req, _to_reply(head, parts))

    def forget(self, rid: int) -> None:
        """The caller gave up on `rid`: its reply, if it still comes, is dropped."""
        self._arrived.pop(rid, None)
        if rid in self._waiting:
            self._waiting[rid] = None

    @property
    def in_flight(self) -> int:
        return len(self._waiting)

    def _drain(self, timeout: float) -> int:
        """Take every reply that arrived (waiting up to `timeout` s for the first); returns how many."""
        got = 0
        if not self._sock.poll(max(0, math.ceil(timeout * 1000)), zmq.POLLIN):  # under 1 ms left: 1, not a spin
            return 0
        while True:
            try:
                parts = self._sock.recv_multipart(copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                return got
            got += 1
            try:
                rid, head = _parse(parts)
            except KVProtocolError:
                continue  # undecodable: nobody's reply
            if rid not in self._waiting:
                continue  # not ours (never sent, or its caller already took its result)
            if self._waiting[rid] is None:
                del self._waiting[rid]  # fire and forget, or forgotten: done
            else:
                self._arrived[rid] = head, parts

    def close(self) -> None:
        self._sock.close(linger=0)
