"""Verified reads end to end, through real kvserver processes: a load whose bytes do not match the
checksum their writer committed fails (every block of its range reported), never serves them.

Covers: a flipped byte in the arena (shm and tcp data planes, both copy paths), a commit that never
wrote its slot (the slot still holds an evicted object's bytes), and the checksum surviving an L2
round trip across a server restart.
"""

from __future__ import annotations
from kvtestkit.kvhelpers import sid

import mmap
import os

import numpy as np
import pytest
import torch
from engine_kv_helpers import Geometry, block_of
from kvconnector.engine_client import EngineClient
from kvprotocol import Client, KeySpace, pack_tokens
from kvprotocol.kvsum import kvsum64

GEO = Geometry("vllm_cpu")
LAY = GEO.layout()
CHUNK = GEO.chunk_size
BPC = CHUNK // GEO.block_size
MODEL = "verify/model"


@pytest.fixture
def server(server_factory):  # type: ignore[no-untyped-def]
    return server_factory("--l1-size-gb", "0.05", "--chunk-size", str(CHUNK), "--lease-ttl", "30")


def engine(server, mode: str = "auto", **kw) -> EngineClient:
    return EngineClient(server.url, MODEL, 1, 0, [LAY], mode=mode, **kw)


def tokens_for(seed: int, chunks: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, chunks * CHUNK)


class ArenaBytes:
    """The test's own read-write mapping of the server's arena (what any process of its user can do)."""

    def __init__(self, c: Client) -> None:
        l1 = c.call("describe").result["l1"]
        fd = os.open(f"/dev/shm/{l1['arena']}", os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, l1["capacity_bytes"])
        finally:
            os.close(fd)

    def flip(self, offset: int) -> None:
        self.mm[offset] ^= 0x40

    def close(self) -> None:
        self.mm.close()


def objects_of(c: Client, tokens: np.ndarray, session: str = sid("peek")) -> list[dict]:
    """Where the server keeps the objects of `tokens` (offset, size, checksum), via a raw retrieve."""
    ks = KeySpace.from_layouts(MODEL, 1, [LAY])
    hit = c.call("lookup", keyspace=ks.to_wire(), tokens=pack_tokens(tokens), session=session).result
    objs = c.call("retrieve", session=session, rank=0, start_chunk=0, end_chunk=hit["hit_chunks"], mode="shm").result[
        "objects"
    ]
    c.call("end_session", session=session)
    return objs


def assert_blocks_equal(
    dst: list[torch.Tensor], dst_ids: list[int], src: list[torch.Tensor], src_ids: list[int]
) -> None:
    for layer in range(GEO.num_layers):
        for d, s in zip(dst_ids, src_ids, strict=True):
            assert torch.equal(block_of("vllm_cpu", dst[layer], d), block_of("vllm_cpu", src[layer], s))


@pytest.mark.parametrize(("mode", "backend"), [("shm", "host"), ("tcp", "host"), ("shm", "torch")])
def test_a_flipped_arena_byte_fails_the_load_and_is_never_served(server, mode: str, backend: str) -> None:
    src, dst = GEO.random_kv(16, seed=1), GEO.sentinel_kv(16)
    tokens = tokens_for(1, 3)
    ids = list(range(3 * BPC))
    dst_ids = [15 - i for i in ids]
    with server.client() as raw, engine(server) as a, engine(server, mode, copy_backend=backend) as b:
        assert a.register(src) and b.register(dst) and b.data_mode == mode
        assert a.save(tokens, ids).saved_chunks == 3
        objs = objects_of(raw, tokens)
        assert [o["checksum"] for o in objs] == [
            kvsum64(ArenaBytes(raw).mm[o["offset"] : o["offset"] + o["size"]]) for o in objs
        ]
        arena = ArenaBytes(raw)
        victim = objs[1]["offset"] + objs[1]["size"] - 3  # one byte near the end of chunk 1
        arena.flip(victim)
        assert b.lookup(tokens, session=sid("s1")).hit_tokens == 3 * CHUNK  # the index cannot know
        res = b.load(sid("s1"), tokens, dst_ids, 0, 3 * CHUNK)
        assert not res.ok and res.loaded_tokens == 0
        assert res.failed_block_ids == sorted(dst_ids)  # every block of the range, so all are recomputed
        assert "checksum" in (res.error or "")
        assert (b.verify_failures, b.verify_failed_objects) == (1, 1)
        b.release(sid("s1"))
        # the load's release reported chunk 1: the server checked it, found it damaged and dropped it
        counters = raw.call("describe").result["counters"]
        assert (counters["corrupt_dropped"], counters["corrupt_refuted"]) == (1, 0)
        assert b.lookup(tokens).hit_tokens == CHUNK  # no later load meets it
        assert a.save(tokens, ids).saved_chunks >= 1  # stored again: the same load now verifies and is exact
        assert b.lookup(tokens, session=sid("s2")).hit_tokens == 3 * CHUNK
        assert b.load(sid("s2"), tokens, dst_ids, 0, 3 * CHUNK).ok
        b.release(sid("s2"))
        arena.close()
    assert_blocks_equal(dst, dst_ids, src, ids)


def test_a_load_starting_mid_object_still_checks_the_whole_object(server) -> None:
    """The engine holds the first blocks of chunk 0: the load reads only part of the object, but a
    flipped byte in the part it does not read still fails it (the checksum covers the object)."""
    src, dst = GEO.random_kv(8, seed=2), GEO.sentinel_kv(8)
    tokens = tokens_for(2, 1)
    with server.client() as raw, engine(server) as a, engine(server) as b:
        assert a.register(src) and b.register(dst)
        assert a.save(tokens, list(range(BPC))).saved_chunks == 1
        obj = objects_of(raw, tokens)[0]
        arena = ArenaBytes(raw)
        arena.flip(obj["offset"] + 5)  # in block 0 of layer 0, which the load skips
        assert b.lookup(tokens, session=sid("m")).hit_tokens == CHUNK
        res = b.load(sid("m"), tokens, list(range(BPC)), 2 * GEO.block_size, CHUNK)
        assert not res.ok and res.failed_block_ids == [2, 3]
        arena.close()


def test_a_commit_that_never_wrote_cannot_serve_an_evicted_objects_bytes(server) -> None:
    """A writer reserves a slot, never fills it and commits: the slot still holds the bytes of the
    object evicted before it (possibly another tenant's). Its commit had to name a checksum, which the
    stale bytes do not have, so the reader misses and recomputes instead of serving them."""
    src, dst = GEO.random_kv(8, seed=3), GEO.sentinel_kv(8)
    first, second = tokens_for(3, 1), tokens_for(4, 1)
    ks = KeySpace.from_layouts(MODEL, 1, [LAY])
    with server.client() as raw, engine(server) as a, engine(server) as b:
        assert a.register(src) and b.register(dst)
        assert a.save(first, list(range(BPC))).saved_chunks == 1
        old = objects_of(raw, first)[0]
        assert raw.call("clear").result  # the object is gone, its slot free; its bytes are still there
        reply = raw.call("store", keyspace=ks.to_wire(), tokens=pack_tokens(second), rank=0, mode="shm").result
        slot = reply["slots"][0]
        assert slot["status"] == "reserved" and slot["offset"] == old["offset"]  # the same slot
        claimed = kvsum64(np.random.default_rng(9).integers(0, 256, slot["size"], dtype=np.uint8))
        raw.call("commit", store_id=reply["store_id"], checksums=[claimed])  # nothing was written
        assert b.lookup(second, session=sid("u")).hit_tokens == CHUNK
        res = b.load(sid("u"), second, list(range(BPC)), 0, CHUNK)
        assert not res.ok and res.failed_block_ids == list(range(BPC)) and b.verify_failures == 1


def test_the_checksum_survives_an_l2_round_trip_and_restart(server_factory, tmp_path) -> None:
    args = ("--l1-size-gb", "0.05", "--chunk-size", str(CHUNK), "--l2", f"fs://{tmp_path / 'l2'}")
    src, dst = GEO.random_kv(12, seed=4), GEO.sentinel_kv(12)
    tokens = tokens_for(5, 2)
    first = server_factory(*args)
    with first.client() as raw, engine(first) as a:
        assert a.register(src) and a.save(tokens, list(range(2 * BPC))).saved_chunks == 2
        written = [o["checksum"] for o in objects_of(raw, tokens)]
    first.stop()  # a graceful stop flushes the write-behind queue
    second = server_factory(*args)  # L1 empty, L2 directory kept
    with second.client() as raw, engine(second) as b:
        assert b.register(dst)
        assert b.lookup(tokens, session=sid("l2")).hit_tokens == 2 * CHUNK  # prefetched from L2
        ids = [11 - i for i in range(2 * BPC)]
        assert b.load(sid("l2"), tokens, ids, 0, 2 * CHUNK).ok  # verified against the checksum from the blob
        b.release(sid("l2"))
        assert [o["checksum"] for o in objects_of(raw, tokens)] == written
        assert b.verify_failures == 0
    assert_blocks_equal(dst, ids, src, list(range(2 * BPC)))
