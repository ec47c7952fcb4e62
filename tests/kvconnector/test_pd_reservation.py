"""Whole-request reservations with a real kvserver and real producer processes (EngineClient each).

The seed's scenario: an L1 arena of exactly 10 chunks and two producers of 8 chunks each, storing
chunk by chunk in turn (chunked prefill). Without reservations they thrash: a consumer that reads each
request right after its producer finished does not find both whole. With reservations the second is
told RETRY_LATER until the first completes, and both are read whole, in turn.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvconnector.engine_client import EngineClient
from pd_producer import GEO, MODEL, tokens_of

CHUNKS = 8
CHUNK_BYTES = GEO.layout().object_bytes
ARENA_GB = str(10 * CHUNK_BYTES / (1 << 30))  # exactly 10 chunks of L1
BLOCKS = CHUNKS * GEO.chunk_size // GEO.block_size
HERE = Path(__file__).parent


class Producer:
    """One producer engine process; `step()` stores its next chunk and returns the SaveResult fields."""

    def __init__(self, url: str, seed: int, reservation: str | None) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)])}
        self.seed = seed
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "pd_producer.py"), url, str(seed), str(CHUNKS), reservation or "-"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert json.loads(self._line())["ready"]

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "producer exited"
        return line

    def step(self) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)


@pytest.fixture
def producers():
    made: list[Producer] = []

    def make(url: str, seed: int, reservation: str | None) -> Producer:
        made.append(Producer(url, seed, reservation))
        return made[-1]

    yield make
    for p in made:
        p.close()


def read_whole(server, seed: int) -> int:
    """Tokens a consumer finds of request `seed`; when whole, also load it and check every byte."""
    tokens = tokens_of(seed, CHUNKS)
    with EngineClient(server.url, MODEL, 1, 0, [GEO.layout()], mode="shm", timeout=5.0) as consumer:
        dst = GEO.sentinel_kv(BLOCKS)
        assert consumer.register(dst)
        session = secrets.token_hex(16)
        hit = consumer.lookup(tokens, session=session).hit_tokens
        if hit < len(tokens):
            consumer.release(session)
            return hit
        assert consumer.load(session, tokens, list(range(BLOCKS)), 0, hit).ok
        src = GEO.random_kv(BLOCKS, seed=seed)
        assert all(torch.equal(d, s) for d, s in zip(dst, src))
        return hit


def test_without_reservations_two_producers_thrash(server_factory, producers) -> None:
    server = server_factory("--l1-size-gb", ARENA_GB, "--chunk-size", "64", "--lease-ttl", "30")
    a, b = producers(server.url, 1, None), producers(server.url, 2, None)
    found = {}
    for _ in range(CHUNKS):
        a.step()
        b.step()
    found["a"] = read_whole(server, 1)
    found["b"] = read_whole(server, 2)
    whole = CHUNKS * GEO.chunk_size
    assert not (found["a"] == whole and found["b"] == whole), found
    assert min(found.values()) < whole // 2, found  # one of them lost most of its prefix


def test_with_reservations_both_complete_in_turn(server_factory, producers) -> None:
    server = server_factory("--l1-size-gb", ARENA_GB, "--chunk-size", "64", "--lease-ttl", "30")
    a = producers(server.url, 1, secrets.token_hex(16))
    b = producers(server.url, 2, secrets.token_hex(16))
    refused = 0
    while True:  # the same interleaving as above: A and B take turns, each one chunk a turn
        ra = a.step() if a_left(a) else None
        rb = b.step()
        if ra is not None:
            assert ra["ok"], ra
        if rb["retry_later"]:
            assert rb["saved_chunks"] == 0 and not rb["no_space"]
            refused += 1
        else:
            assert rb["ok"], rb
        if rb["done"] == CHUNKS:
            break
        if ra is not None and ra["done"] == CHUNKS:
            # A is whole now: its consumer reads it before B may take its room
            assert read_whole(server, 1) == CHUNKS * GEO.chunk_size
            a.proc.stdin.write("exit\n")
            a.proc.stdin.flush()
            a.finished = True
    assert refused >= CHUNKS - 1  # B waited (took nothing) while A was in flight
    assert read_whole(server, 2) == CHUNKS * GEO.chunk_size
    with server.client() as c:
        book = c.call("describe").result["reservations"]
    assert book["admitted"] == book["completed"] == 2 and book["live"] == 0 and book["outstanding_bytes"] == 0
    assert book["retry_later"] == refused and book["rolled_back"] == 0


def a_left(p: Producer) -> bool:
    return not getattr(p, "finished", False)


def test_consumer_sees_inflight_and_a_killed_producer_is_rolled_back(server_factory, producers) -> None:
    server = server_factory("--l1-size-gb", ARENA_GB, "--chunk-size", "64", "--lease-ttl", "3")
    a = producers(server.url, 1, secrets.token_hex(16))
    b = producers(server.url, 2, secrets.token_hex(16))
    tokens = tokens_of(1, CHUNKS)
    with EngineClient(server.url, MODEL, 1, 0, [GEO.layout()], mode="shm", timeout=5.0) as consumer:
        consumer.register(GEO.sentinel_kv(BLOCKS))
        assert not consumer.lookup(tokens, wait=False).inflight  # nobody writes it yet: a plain miss
        for _ in range(3):
            assert a.step()["ok"]
        look = consumer.lookup(tokens, wait=False)
        assert look.hit_tokens == 3 * GEO.chunk_size and look.inflight  # not a plain miss
        assert b.step()["retry_later"]  # A's 5 outstanding chunks + B's 8 do not fit in 10
        os.kill(a.proc.pid, signal.SIGKILL)  # the producer dies mid-request
        a.proc.wait(5)
        deadline = time.monotonic() + 15
        while True:  # within the lease TTL (3 s) plus a sweep, A is rolled back
            look = consumer.lookup(tokens, wait=False)
            if look.hit_tokens == 0 and not look.inflight:
                break
            assert time.monotonic() < deadline, look
            time.sleep(0.1)
        for _ in range(CHUNKS):
            res = b.step()
            assert res["ok"], res  # A's booking is gone: B is admitted and completes
    assert read_whole(server, 2) == CHUNKS * GEO.chunk_size
    assert read_whole(server, 1) == 0  # A's partial chunks were dropped
    with server.client() as c:
        book = c.call("describe").result["reservations"]
    assert book["rolled_back"] == 1 and book["completed"] == 1 and book["live"] == 0
