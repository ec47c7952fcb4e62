"""Bystander pings while KV-events subscribers attack: a stranger subscribing without the token, and a
token holder flooding the replay socket with 8-byte requests.

Starts a real kvserver with tenant alice (the real CLI, a temporary state directory) publishing
KV events on loopback, fills its replay buffer, then alternates rounds (harness: bystander.py). In
"attack" rounds one thread reconnects anonymous SUB and replay sockets (refused at the PLAIN
handshake) and another sends replay requests from seq 0 as fast as it can and drains the answers;
in "quiet" rounds nothing. Alice pings throughout. Afterwards it prints what the strangers received
and what the server replayed against what was asked.
Run: `uv run python -m bench.isolation.events_pings`.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import zmq
from bench.isolation.bystander import Server, alternate, free_port, report
from kvtestkit.tenants import add_tenant

from kvprotocol import Client, KeySpace, resolve_token

from kvtestkit.kvhelpers import payload, register, store, tiny_layout


def strangers(pub: str, rep: str, stop: threading.Event, got: list[int]) -> None:
    ctx = zmq.Context()
    while not stop.is_set():
        sub, req = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub)
        req.connect(rep)
        req.send_multipart([b"", (0).to_bytes(8, "big")])
        for sock in (sub, req):
            if sock.poll(50):
                got[0] += 1
            sock.close(linger=0)
    ctx.destroy(linger=0)


def flood(rep: str, token: str, stop: threading.Event, counts: list[int]) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.plain_username, sock.plain_password = b"kvserver", token.encode()
    sock.connect(rep)
    while not stop.is_set():
        for _ in range(50):
            sock.send_multipart([b"", (0).to_bytes(8, "big")], flags=zmq.NOBLOCK)
            counts[0] += 1
        deadline = time.monotonic() + 0.05
        while time.monotonic() < deadline:
            if sock.poll(10):
                counts[1] += sum(len(f) for f in sock.recv_multipart())
    ctx.destroy(linger=0)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tenants = Path(tmp) / "tenants.json"
        alice_tok = add_tenant(tenants, "alice")
        pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        flags = ["--l1-size-gb", "0.05", "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", rep]
        srv = Server(Path(tmp), tenants, *flags)
        try:
            pinger = srv.client(alice_tok)
            import os

            os.environ["KVSERVER_STATE_DIR"] = tmp
            token = resolve_token(None, srv.url) or ""
            admin = Client(srv.url, token=token)
            ks: KeySpace = register(admin, layouts=[tiny_layout()])[0]
            size = tiny_layout().object_bytes
            for p in range(2000):  # ~2 MB of batches to replay
                store(admin, ks, [10_000 + p] * 256, lambda ch, g, seed=p: payload(seed, size))
            got, counts = [0], [0, 0]

            def attack(stop: threading.Event) -> None:
                t = threading.Thread(target=strangers, args=(pub, rep, stop, got))
                t.start()
                flood(rep, token, stop, counts)
                t.join()

            times = alternate(pinger, attack)
            report("events", times)
            kv = admin.call("describe").result["kv_events"]
            print(f"strangers: messages received {got[0]}")
            print(
                f"flood: {counts[0]} requests ({8 * counts[0]} bytes), {counts[1] / 1e6:.1f} MB received; server: "
                f"replays {kv['replays']}, cut {kv['replays_cut']}, replayed {kv['replay_bytes'] / 1e6:.1f} MB, "
                f"paced {kv['replay_paced_s']} s"
            )
            admin.close()
            pinger.close()
        finally:
            srv.stop()


if __name__ == "__main__":
    main()
