"""EngineClient failure semantics: a killed, frozen or restarted server, and a server whose replies
point outside the arena. The client must answer with typed errors, within its timeout, never raise,
never report half-written blocks as loaded, and recover by itself."""

from __future__ import annotations
from kvtestkit.kvhelpers import sid

import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
import torch
import zmq

from engine_kv_helpers import Geometry, untouched
from kvprotocol._shm import SHM_DIR
from kvprotocol._shm import ShmMapping as ArenaMap
from kvconnector.engine_client import EngineClient
from kvtestkit.serverproc import free_port

GEO = Geometry("vllm_cpu", chunk_size=64)
TIMEOUT = 0.5


def make_client(server, mode: str = "auto", **kw) -> EngineClient:
    return EngineClient(server.url, "fail/model", 1, 0, [GEO.layout()], mode=mode, timeout=TIMEOUT, **kw)


def until_ok(fn, what: str, limit: float = 15.0):
    deadline = time.monotonic() + limit
    while True:
        res = fn()
        if res.error is None:
            return res
        assert time.monotonic() < deadline, f"{what} did not recover: {res.error}"
        time.sleep(0.05)


@pytest.mark.parametrize("mode", ["shm", "tcp"])
def test_killed_server_fails_loads_and_lookups_then_restart_recovers(server_factory, mode: str) -> None:
    server = server_factory("--l1-size-gb", "0.05", "--chunk-size", "64")
    tokens = np.arange(192) + 11
    src = GEO.random_kv(16, seed=1)
    with make_client(server, mode) as a, make_client(server, mode) as b:
        assert a.register(src)
        dst = GEO.sentinel_kv(16)
        assert b.register(dst)
        assert a.save(tokens, list(range(12))).ok
        assert b.lookup(tokens, session=sid("s1")).hit_tokens == 192
        server.kill()

        started = time.monotonic()
        res = b.load(sid("s1"), tokens, list(range(15, 3, -1)), 64, 192)
        assert time.monotonic() - started < TIMEOUT + 2.0  # bounded by the timeout, never a hang
        assert not res.ok and res.loaded_tokens == 0
        assert res.failed_block_ids == sorted(range(15, 3, -1)[4:12])  # every block of the load range
        assert res.error and res.error.startswith(("timeout", "unavailable"))
        look = b.lookup(tokens)
        assert look.hit_tokens == 0 and look.error
        assert not a.save(tokens, list(range(12))).ok

        server.args.append("--cold")  # same port, a fresh (empty) arena (warm adoption: test_restart_ride_through.py)
        server.start()
        until_ok(lambda: b.lookup(tokens), "lookup")
        assert b.lookup(tokens).hit_tokens == 0  # the restarted server has an empty cache
        assert until_ok(lambda: a.save(tokens, list(range(12))), "save").saved_chunks == 3
        # a tcp reader sees exactly what the recovered writer stored: in shm mode this proves the
        # writer mapped the new arena instead of writing into the stale one
        with make_client(server, "tcp") as reader:
            fresh = GEO.sentinel_kv(16)
            reader.register(fresh)
            assert reader.lookup(tokens, session=sid("s2")).hit_tokens == 192
            assert reader.load(sid("s2"), tokens, list(range(12)), 0, 192).ok
        for layer in range(GEO.num_layers):
            assert all(torch.equal(fresh[layer][j], src[layer][j]) for j in range(12))


def test_frozen_server_times_out_within_the_timeout_then_recovers(server_factory, caplog) -> None:
    server = server_factory("--l1-size-gb", "0.05", "--chunk-size", "64")
    tokens = np.arange(64) + 5
    with make_client(server, backoff=2.0) as c:  # a back-off long enough for the fail-fast calls below
        c.register(GEO.random_kv(8, seed=2))
        assert c.save(tokens, [0, 1, 2, 3]).ok
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            with caplog.at_level(logging.WARNING, logger="kvconnector.engine_client"):
                started = time.monotonic()
                res = c.lookup(tokens)
                assert time.monotonic() - started < TIMEOUT + 2.0  # bounded by the timeout, never a hang
                assert res.hit_tokens == 0 and res.error and res.error.startswith("timeout")
                quick = [c.lookup(tokens) for _ in range(5)]  # back-off: fail fast, do not stall
                assert all(r.error and r.error.startswith("unavailable") for r in quick)
            warnings = [r for r in caplog.records if "lookup failed" in r.getMessage()]
            assert len(warnings) == 2  # one per failure kind (timeout, unavailable), not one per call
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert until_ok(lambda: c.lookup(tokens), "lookup").hit_tokens == 64
        assert until_ok(lambda: c.save(np.arange(64) + 99, [4, 5, 6, 7]), "save").saved_chunks == 1


def test_arena_identity_changes_when_the_file_is_recreated() -> None:
    name = f"kvconnector-test-{uuid.uuid4().hex[:12]}"
    path = SHM_DIR / name
    path.write_bytes(bytes(8192))
    try:
        arena = ArenaMap(name, 8192)
        assert arena.is_current()
        arena.check_range(4096, 4096)
        for off, size in ((4097, 4096), (-1, 10), (0, 8193)):
            with pytest.raises(ValueError):
                arena.check_range(off, size)
        path.unlink()
        assert not arena.is_current()
        path.write_bytes(bytes(8192))  # a restarted server's arena under the same name
        assert not arena.is_current()
        arena.close()
        with pytest.raises(ValueError):
            ArenaMap(name, 1 << 20)  # the file is smaller than announced
    finally:
        path.unlink(missing_ok=True)


class HostileServer:
    """A ROUTER that answers like a kvserver but hands out offsets outside its (real, tiny) arena."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.arena = f"kvconnector-hostile-{uuid.uuid4().hex[:12]}"
        self.nonce = os.urandom(16)
        (SHM_DIR / self.arena).write_bytes((b"KVSARENA" + self.nonce).ljust(4096, b"\0"))  # a real header
        self.ops: list[str] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        self._ready.wait(5)

    def _answer(self, msg: dict) -> dict:
        op = msg["op"]
        self.ops.append(op)
        obj = GEO.layout().object_bytes
        results = {
            "register_engine": {
                "engine_id": "e1",
                "chunk_size": 64,
                "groups": [],
                "arena": {"name": self.arena, "size": 4096, "nonce": self.nonce.hex()},
            },
            "lookup": {"hit_tokens": 64, "hit_chunks": 1, "num_chunks": 1, "chunk_size": 64},
            "retrieve": {
                "objects": [{"chunk": 0, "group": 0, "size": obj, "offset": 1 << 40, "checksum": 0}],
                "lease": 1,
            },
            "store": {
                "store_id": "st1",
                "slots": [{"chunk": 0, "group": 0, "status": "reserved", "size": obj, "offset": 4000}],
            },
        }
        return {"id": msg["id"], "ok": True, "result": results.get(op, {})}

    def _serve(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.bind(self.url)
        self._ready.set()
        while not self._stop.is_set():
            if sock.poll(50):
                ident, header, *_ = sock.recv_multipart()
                reply = self._answer(msgpack.unpackb(header, raw=False))
                sock.send_multipart([ident, msgpack.packb(reply, use_bin_type=True)])
        sock.close(0)
        ctx.term()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        (SHM_DIR / self.arena).unlink(missing_ok=True)


@pytest.fixture
def hostile() -> Iterator[HostileServer]:
    srv = HostileServer()
    yield srv
    srv.close()


def test_replies_pointing_outside_the_arena_are_refused(hostile: HostileServer) -> None:
    dst = GEO.sentinel_kv(8)
    with EngineClient(hostile.url, "fail/model", 1, 0, [GEO.layout()], mode="shm", timeout=2.0) as c:
        assert c.register(dst)
        res = c.load(sid("s"), np.arange(64), [0, 1, 2, 3], 0, 64)
        assert not res.ok and res.failed_block_ids == [0, 1, 2, 3] and "outside" in (res.error or "")
        assert all(untouched("vllm_cpu", dst[layer], b) for layer in range(2) for b in range(8))
        saved = c.save(np.arange(64), [0, 1, 2, 3])
        assert not saved.ok and "outside" in (saved.error or "")
    assert hostile.ops.count("abort") == 1 and "commit" not in hostile.ops
