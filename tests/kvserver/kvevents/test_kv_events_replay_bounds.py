"""#34 Low: 8-byte replay requests cannot make the server send gigabytes or stall it.

One answer carries at most --kv-events-replay-max-bytes of batches (at least one); a subscriber gets
the rest by asking again from the next seq. All answers together are paced to
--kv-events-replay-rate, so a flood of requests from a token holder is bounded in bytes a second
while a bystander tenant keeps being answered.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import zmq

from kvevents_util import EventServer, start_event_server
from kvtestkit.kvhelpers import payload, register, store, tiny_layout
from kvprotocol import Client

BIN = Path(sys.executable).parent
MAX = 1 << 16  # the smallest --kv-events-replay-max-bytes
RATE = 1 << 16  # the smallest --kv-events-replay-rate (bytes a second)


def _fill(srv: EventServer, prompts: int) -> int:
    """One batch per single-chunk prompt (~850 bytes each); returns next_seq."""
    size = tiny_layout().object_bytes
    with srv.proc.client() as c:
        ks, _ = register(c, layouts=[tiny_layout()])
        for p in range(prompts):
            store(c, ks, [10_000 + p] * 256, lambda ch, g, seed=p: payload(seed, size))
        return int(c.call("describe").result["kv_events"]["next_seq"])


def _size(batches: list) -> int:  # type: ignore[type-arg]
    return sum(len(b.topic) + len(b.payload) for b in batches)


def test_one_request_gets_at_most_max_bytes_and_asking_again_gets_the_rest(server_factory) -> None:
    srv = start_event_server(server_factory, "--l1-size-gb", "0.05", "--kv-events-replay-max-bytes", str(MAX))
    next_seq = _fill(srv, 200)  # ~170 KB of batches: three answers
    first = srv.replay(0)
    assert first[0].seq == 0 and _size(first) <= MAX and first[-1].seq < next_seq - 1
    got, start = [], 0
    while start < next_seq:  # the documented client loop: ask again from the next seq
        part = srv.replay(start)
        assert part and _size(part) <= MAX
        got += part
        start = part[-1].seq + 1
    seqs = [b.seq for b in got]  # a batch published after next_seq was read may come along too
    assert seqs == list(range(len(seqs))) and len(seqs) >= next_seq  # nothing lost, nothing twice
    with srv.proc.client() as c:
        kv = c.call("describe").result["kv_events"]
    assert kv["replays_cut"] >= 3 and kv["replay_bytes"] >= 2 * MAX


def test_a_flood_of_replay_requests_is_paced_and_a_bystander_keeps_working(server_factory, tmp_path) -> None:
    tenants = tmp_path / "tenants.json"
    alice_token = subprocess.run(
        [str(BIN / "kvserver"), "tenant", "add", "alice", "--tenants-file", str(tenants)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    srv = start_event_server(
        server_factory,
        "--l1-size-gb",
        "0.05",
        "--tenants-file",
        str(tenants),
        "--kv-events-replay-max-bytes",
        str(MAX),
        "--kv-events-replay-rate",
        str(RATE),
    )
    _fill(srv, 100)
    ctx = zmq.Context()
    flood = ctx.socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    flood.plain_username, flood.plain_password = (p.encode() for p in srv.plain)
    flood.connect(srv.replay_endpoint)
    t0 = time.monotonic()
    for _ in range(200):  # 1.6 KB of requests for 200 x 64 KiB of answers
        flood.send_multipart([b"", (0).to_bytes(8, "big")])
    received = 0
    size = tiny_layout().object_bytes
    try:
        with Client(srv.proc.url, token=alice_token, timeout=5) as alice:
            ks, _ = register(alice, layouts=[tiny_layout()])
            for i in range(30):  # the bystander: every call answered (the client times out at 5 s)
                alice.ping()
                store(alice, ks, [20_000 + i] * 256, lambda ch, g, seed=i: payload(seed, size))
                while flood.poll(0):
                    received += sum(len(f) for f in flood.recv_multipart())
        deadline = time.monotonic() + 30  # under load the flood's first answer may come after the bystander
        while received == 0 and time.monotonic() < deadline:
            if flood.poll(100):
                received += sum(len(f) for f in flood.recv_multipart())
        with srv.proc.client() as c:
            kv = c.call("describe").result["kv_events"]
        elapsed = time.monotonic() - t0
    finally:
        ctx.destroy(linger=0)
    # the bucket holds one second's worth; beyond it, RATE bytes a second (each batch charged 256 more)
    assert kv["replay_bytes"] <= RATE * (elapsed + 1) + MAX, (kv, elapsed)
    assert kv["replays"] < 200 and 0 < received <= kv["replay_bytes"] + 64 * (kv["replays"] + 1) * 100
