"""A hostile client, running throughout the soak: malformed, oversized and nonsensical messages on
raw ZMQ sockets, with and without a valid tenant token. The server owes each an error reply; what it
answered is counted by code, and what went unanswered while the server was up is counted too."""

from __future__ import annotations

import os
import random
import threading
from collections import Counter
from collections.abc import Callable

import msgpack
import zmq

from kvprotocol import PROTOCOL_VERSION


def _cases(token: str) -> list[tuple[str, Callable[[], list[bytes]]]]:
    def req(op: str, **fields: object) -> bytes:
        return msgpack.packb({"v": PROTOCOL_VERSION, "id": 7, "op": op, "auth": token, **fields}, use_bin_type=True)

    ks = {"model": "soak/model", "groups": ["00" * 8], "world_size": 1, "kv_rank": 0}
    return [
        ("garbage", lambda: [os.urandom(random.randint(1, 512))]),
        ("empty", lambda: [b""]),
        ("not_a_map", lambda: [msgpack.packb([1, 2, 3])]),
        ("bad_version", lambda: [msgpack.packb({"v": 99, "id": 1, "op": "ping"})]),
        ("unknown_op", lambda: [req("drop_tables")]),
        ("no_auth_store", lambda: [msgpack.packb({"v": PROTOCOL_VERSION, "id": 3, "op": "store"})]),
        ("oversized_header", lambda: [b"\x00" * (5 << 20)]),
        ("huge_tokens", lambda: [req("lookup", keyspace=ks, tokens=b"\x00" * (4 << 20) + b"\x00" * 8)]),
        ("odd_tokens", lambda: [req("lookup", keyspace=ks, tokens=b"\x01" * 7)]),
        ("many_frames", lambda: [req("ping"), *[b"x" * 1024] * 64]),
        (
            "store_bad_frames",
            lambda: [req("store", keyspace=ks, tokens=b"\x01\x00\x00\x00" * 64, rank=0, mode="tcp"), b"z" * 7],
        ),
        (
            "retrieve_foreign",
            lambda: [req("retrieve", session="s" * 22, rank=0, start_chunk=0, end_chunk=4, mode="tcp")],
        ),
        ("release_foreign", lambda: [req("release", session="x" * 22)]),
    ]


class Hostile(threading.Thread):
    """Sends one bad message at a time and waits (bounded) for its reply."""

    def __init__(self, url: str, token: str, seed: int, server_up: Callable[[], bool]) -> None:
        super().__init__(daemon=True, name="hostile")
        self.url, self.server_up = url, server_up
        self.cases = _cases(token)
        self.random = random.Random(seed)
        self.sent: Counter[str] = Counter()
        self.replies: Counter[str] = Counter()
        self.unanswered: Counter[str] = Counter()
        self.by_case: Counter[str] = Counter()
        self.stopping = threading.Event()

    def run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        while not self.stopping.wait(self.random.uniform(0.05, 0.3)):
            name, make = self.random.choice(self.cases)
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.connect(self.url)
                up = self.server_up()
                sock.send_multipart(make())
                self.sent[name] += 1
                if sock.poll(2000):
                    reply = msgpack.unpackb(sock.recv_multipart()[0], raw=False)
                    code = reply.get("error", {}).get("code", "OK") if isinstance(reply, dict) else "NOT_A_MAP"
                    self.replies[str(code)] += 1
                    self.by_case[f"{name}:{code}"] += 1
                elif name.startswith("oversized"):
                    self.replies["dropped_over_max_message_size"] += 1  # ZMQ drops such a peer, no reply
                elif up and self.server_up():
                    self.unanswered[name] += 1
            finally:
                sock.close()

    def summary(self) -> dict[str, dict[str, int]]:
        return {
            "sent": dict(self.sent),
            "replies": dict(self.replies),
            "unanswered_while_up": dict(self.unanswered),
            "by_case": dict(self.by_case),
        }
