"""An engine only reads and writes an arena that carries the instance nonce its server announced:
a mapping of any other file under the arena's name (stale, foreign, tampered) becomes a miss (shm)
or falls back to tcp (auto), never a read of someone else's bytes."""

from __future__ import annotations
from kvtestkit.kvhelpers import sid

import os

import numpy as np
import torch

from engine_kv_helpers import Geometry
from kvconnector.engine_client import EngineClient

GEO = Geometry("vllm_cpu")


def _poke(path: str, offset: int, data: bytes) -> bytes:
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, len(data), offset)
        os.pwrite(fd, data, offset)
        return old
    finally:
        os.close(fd)


def test_an_arena_without_the_servers_nonce_is_never_used(server_factory) -> None:
    srv = server_factory("--l1-size-gb", "0.05", "--chunk-size", "64")
    lay = GEO.layout()
    tokens = np.arange(128)
    src, dst = GEO.random_kv(8, seed=3), GEO.sentinel_kv(8)
    seg = f"/dev/shm/kvserver-{srv.port}"
    with (
        EngineClient(srv.url, "nonce/model", 1, 0, [lay], mode="shm") as writer,
        EngineClient(srv.url, "nonce/model", 1, 0, [lay], mode="shm") as shm_reader,
    ):
        assert writer.register(src) and shm_reader.register(dst)
        assert writer.save(tokens, list(range(8))).ok
        assert shm_reader.lookup(tokens, session=sid("a")).hit_tokens == 128
        assert shm_reader.load(sid("a"), tokens, list(range(8)), 0, 128).ok

        original = _poke(seg, 8, b"\x00" * 16)  # the header no longer names this server's instance
        assert shm_reader.lookup(tokens, session=sid("b")).hit_tokens == 128
        res = shm_reader.load(sid("b"), tokens, list(range(8)), 0, 128)
        assert not res.ok and "arena_changed" in (res.error or "")
        assert not writer.save(np.arange(1000, 1128), list(range(8))).ok  # nor written

        with EngineClient(srv.url, "nonce/model", 1, 0, [lay], mode="auto") as auto_reader:
            out = GEO.sentinel_kv(8)
            assert auto_reader.register(out)
            assert auto_reader.data_mode == "tcp"  # the name does not lead to its server's arena
            assert auto_reader.lookup(tokens, session=sid("c")).hit_tokens == 128
            assert auto_reader.load(sid("c"), tokens, list(range(8)), 0, 128).ok
            assert all(torch.equal(o, s) for o, s in zip(out, src))

        _poke(seg, 8, original)  # the real arena again: shm works again after re-registering
        for layer in dst:
            layer.fill_(0)
        assert shm_reader.lookup(tokens, session=sid("d")).hit_tokens == 128
        assert shm_reader.load(sid("d"), tokens, list(range(8)), 0, 128).ok
        assert shm_reader.data_mode == "shm"
        assert all(torch.equal(d, s) for d, s in zip(dst, src))
