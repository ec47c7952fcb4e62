"""A stranger on a server's KV-events sockets, run as another OS user by test_kv_events_other_user.py.

argv: PUB endpoint, replay endpoint, then PLAIN passwords to try as user `kvserver` (besides none).
It subscribes to every topic and asks the replay socket for everything from seq 0, once per
credential. Each socket is watched with a ZMQ monitor; once every socket's handshake has either
succeeded or failed it prints `{"handshakes": {name: "admitted" | "refused"}}`. Then it prints
`{"got": name, "tokens": [...]}` for every message that arrives (the token ids of its events), until
a line on stdin tells it to stop; then `{"done": {name: messages received}}`.
"""

from __future__ import annotations

import json
import sys

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


def tokens_of(frames: list[bytes]) -> list[int]:
    """Token ids of the BlockStored events in a PUB (topic, seq, payload) or replay frame set."""
    try:
        _ts, events, _rank = msgpack.unpackb(frames[-1], raw=False)
    except Exception:  # the replay's end marker, or anything else: no tokens
        return []
    return [t for ev in events if ev.get("type") == "BlockStored" for t in ev.get("token_ids", [])]


def main() -> None:
    pub, rep, *passwords = sys.argv[1:]
    ctx = zmq.Context()
    socks: dict[str, zmq.Socket] = {}
    monitors: dict[zmq.Socket, str] = {}
    for i, password in enumerate([None, *passwords]):
        for kind, endpoint in (("sub", pub), ("replay", rep)):
            sock = ctx.socket(zmq.SUB if kind == "sub" else zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if password is not None:
                sock.plain_username, sock.plain_password = b"kvserver", password.encode()
            if kind == "sub":
                sock.setsockopt(zmq.SUBSCRIBE, b"")
            socks[f"{kind}-{i}"] = sock
            # The monitor is attached before connect: a handshake that succeeds once (the open
            # socket) would otherwise be over before anyone watches it.
            monitors[sock.get_monitor_socket()] = f"{kind}-{i}"
            sock.connect(endpoint)
            if kind == "replay":
                sock.send_multipart([b"", (0).to_bytes(8, "big")])  # queued until a handshake succeeds
    outcome: dict[str, str] = {}
    received = dict.fromkeys(socks, 0)
    poller = zmq.Poller()
    for sock in [*socks.values(), *monitors]:
        poller.register(sock, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    reported = False
    while True:
        ready = dict(poller.poll(20_000))
        if not ready:
            raise SystemExit(f"no socket event within 20 s; outcomes so far {outcome}")
        if sys.stdin.fileno() in ready:
            sys.stdin.readline()
            break
        for mon, name in monitors.items():
            if mon in ready:
                event = recv_monitor_message(mon)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    outcome[name] = "admitted"
                elif event & FAILED:
                    outcome.setdefault(name, "refused")
        for name, sock in socks.items():
            while sock in ready and sock.poll(0):
                frames = sock.recv_multipart()
                received[name] += 1
                print(json.dumps({"got": name, "tokens": tokens_of(frames)}), flush=True)
        if not reported and len(outcome) == len(socks):
            print(json.dumps({"handshakes": outcome}), flush=True)
            reported = True
    print(json.dumps({"done": received}), flush=True)
    ctx.destroy(linger=0)


if __name__ == "__main__":
    main()
