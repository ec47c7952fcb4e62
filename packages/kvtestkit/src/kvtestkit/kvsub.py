"""A KV-events subscriber for tests: a real ZMQ SUB socket plus the replay socket, decoding with msgpack.

It speaks exactly what a vLLM `ZmqEventPublisher` subscriber speaks (see vLLM's
examples/online_serving/kv_events_subscriber.py): SUB frames (topic, seq, payload); replay by
sending the first wanted sequence number (8 bytes big-endian) on a DEALER/REQ socket and reading
(topic, seq, payload) frames until seq == -1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

END = -1


@dataclass
class Batch:
    seq: int
    topic: bytes
    payload: bytes

    @property
    def ts(self) -> float:
        return float(msgpack.unpackb(self.payload)[0])

    @property
    def events(self) -> list[dict[str, Any]]:
        return list(msgpack.unpackb(self.payload, raw=False)[1])


class Subscriber:
    def __init__(self, endpoint: str, topic: bytes = b"", *, plain: tuple[str, str] | None = None) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.IPV6, 1)  # also reaches tcp://[::1]:port
        if plain is not None:
            self.sub.plain_username, self.sub.plain_password = (p.encode() for p in plain)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)

    def recv(self, timeout_ms: int = 5000) -> Batch | None:
        if not self.sub.poll(timeout_ms):
            return None
        topic, seq, payload = self.sub.recv_multipart()
        return Batch(int.from_bytes(seq, "big"), topic, payload)

    def recv_until(self, done: Callable[[list[Batch]], bool], timeout_ms: int = 10000) -> list[Batch]:
        """Batches until `done(batches)` holds; fails when the stream stays silent for timeout_ms."""
        got: list[Batch] = []
        while not done(got):
            batch = self.recv(timeout_ms)
            assert batch is not None, f"no KV event within {timeout_ms} ms; got {[b.events for b in got]}"
            got.append(batch)
        return got

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def replay(endpoint: str, start: int, *, plain: tuple[str, str] | None = None, timeout_ms: int = 10000) -> list[Batch]:
    """Ask the replay socket for every buffered batch from `start` on (a DEALER, as vLLM's framing allows)."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)
        if plain is not None:
            sock.plain_username, sock.plain_password = (p.encode() for p in plain)
        sock.connect(endpoint)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[Batch] = []
        while True:
            assert sock.poll(timeout_ms), "replay did not answer"
            empty, topic, seq, payload = sock.recv_multipart()
            assert empty == b""
            n = int.from_bytes(seq, "big", signed=True)
            if n == END:
                assert topic == b"" and payload == b""
                return out
            out.append(Batch(n, topic, payload))
    finally:
        ctx.destroy(linger=0)
