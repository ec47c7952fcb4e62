"""A tcp retrieve reply carries the bytes the object had when it was retrieved, even when the frame
leaves the server long after the lease ended and the slot was reused (a slow network link)."""

from __future__ import annotations

import socket
import threading
import time

from kvtestkit.kvhelpers import lookup, payload, register, store, tiny_layout, sid
from kvprotocol import Client, resolve_token

BIG = tiny_layout(block_bytes=2 << 20)  # 2 layers x 8 blocks x 2 MiB = one 32 MiB object per chunk


class GatedRelay:
    """A real TCP relay between a client and the server whose server->client direction can be
    paused: while paused the server's socket buffers fill and the rest of a reply waits in ZMQ."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.gate = threading.Event()
        self.gate.set()
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        up = socket.socket()
        up.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        up.connect(("127.0.0.1", self.target_port))
        self.socks += [conn, up]
        threading.Thread(target=self._pump, args=(conn, up, False), daemon=True).start()
        threading.Thread(target=self._pump, args=(up, conn, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, gated: bool) -> None:
        try:
            while True:
                if gated:
                    self.gate.wait()
                data = src.recv(1 << 16)
                if not data:
                    return
                dst.sendall(data)
        except OSError:
            return

    def close(self) -> None:
        self.gate.set()
        for s in [self.listener, *self.socks]:
            s.close()


def test_tcp_reply_bytes_do_not_change_after_the_lease_ends(server_factory):
    obj = BIG.object_bytes
    srv = server_factory("--l1-size-gb", str(2 * obj / (1 << 30)), "--lease-ttl", "30")
    t1, t2, t3 = ([k * 1000 + i for i in range(256)] for k in (1, 2, 3))
    relay = GatedRelay(srv.port)
    got: list = []
    ready, go = threading.Event(), threading.Event()

    def slow_reader() -> None:
        # through the relay's port: the server's token, which only its own port's file names
        with Client(f"tcp://127.0.0.1:{relay.port}", timeout=60, token=resolve_token(None, srv.url)) as x:
            x.call("ping")
            ready.set()
            go.wait()
            got.append(x.call("retrieve", session=sid("slow"), rank=0, start_chunk=0, end_chunk=1, mode="tcp"))

    with srv.client(timeout=30) as c:
        ks, _ = register(c, layouts=[BIG])
        store(c, ks, t1, lambda ch, g: payload(1, obj))
        assert lookup(c, ks, t1, session=sid("slow")) == 256
        reader = threading.Thread(target=slow_reader)
        reader.start()
        assert ready.wait(10)
        relay.gate.clear()  # the link to the reader stalls
        go.set()
        deadline = time.monotonic() + 10
        while c.call("describe").result["ops"].get("retrieve", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        # the reply is on its way; the lease ends and the slot is reused for other objects
        assert c.call("release", session=sid("slow")).result["released"]
        store(c, ks, t2, lambda ch, g: payload(2, obj))
        store(c, ks, t3, lambda ch, g: payload(3, obj))
        assert lookup(c, ks, t1) == 0  # the retrieved object was evicted: its slot holds another now
        relay.gate.set()
        reader.join(60)
    relay.close()
    assert len(got) == 1 and len(got[0].frames) == 1
    assert bytes(got[0].frames[0]) == payload(1, obj)
