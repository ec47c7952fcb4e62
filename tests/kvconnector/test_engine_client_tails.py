"""Tails through EngineClient and a real kvserver: the KV past a prompt's last full chunk saved as
one more object, found by a lookup with tails, loaded into other blocks exactly; the object's slots
past the tail's blocks hold zeros, never a reused slot's old bytes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from engine_kv_helpers import TAGS, Geometry, block_of, module_server, untouched
from kvconnector.engine_client import EngineClient, LoadResult, LookupResult
from kvtestkit.kvhelpers import retrieve, sid

kv_server = module_server("--l1-size-gb", "0.1", "--chunk-size", "64", "--lease-ttl", "30")
_seeds = itertools.count(1)


def fresh_tokens(n: int) -> np.ndarray:
    return np.random.default_rng(next(_seeds) * 104729).integers(0, 50_000, n)


def client(server, layouts, mode: str = "auto") -> EngineClient:
    return EngineClient(server.url, "test/model", 1, 0, layouts, mode=mode)


@pytest.mark.parametrize("mode", ["shm", "tcp"])
@pytest.mark.parametrize("tag", TAGS)
def test_a_saved_tail_loads_the_next_turn_to_the_token(kv_server, tag: str, mode: str) -> None:
    geo = Geometry(tag)
    lay = geo.layout()
    src, dst = geo.random_kv(24, seed=11), geo.sentinel_kv(30)
    tokens = fresh_tokens(4 * 64 + 20)  # four full chunks and a tail of 20 tokens: two 16-token blocks
    src_ids = list(range(2, 2 + 18))
    dst_ids = list(np.random.default_rng(6).permutation(30)[:18])
    turn = np.concatenate([tokens, fresh_tokens(50)])
    with client(kv_server, [lay], mode) as a, client(kv_server, [lay], mode) as b:
        assert a.register(src) and b.register(dst)
        assert a.tails is True
        saved = a.save(tokens, src_ids, tail=True)
        assert saved.ok and saved.saved_chunks == 5  # the tail is a fifth object
        assert b.lookup(turn) == LookupResult(256, None)  # without tails: whole chunks
        assert b.lookup(turn, session=sid("s-tail"), tails=True) == LookupResult(276, None)
        res = b.load(sid("s-tail"), turn, dst_ids, skip_tokens=0, num_tokens=276)
        assert res == LoadResult(True, 276, [], None)
        b.release(sid("s-tail"))
    for layer in range(geo.num_layers):
        for j in range(18):  # every block holding a token of the prompt, the tail's two included
            assert torch.equal(block_of(tag, dst[layer], dst_ids[j]), block_of(tag, src[layer], src_ids[j])), j
        for blk in set(range(30)) - set(dst_ids):
            assert untouched(tag, dst[layer], blk)


def test_the_tails_other_slots_hold_zeros(kv_server) -> None:
    geo = Geometry("vllm_cpu")
    lay = geo.layout()
    src = geo.random_kv(24, seed=12)
    tokens = fresh_tokens(64 + 5)  # one chunk and a tail of 5: one block of the tail object's four
    with client(kv_server, [lay], "tcp") as a, kv_server.client() as raw:
        assert a.register(src)
        assert a.save(tokens, list(range(5)), tail=True).saved_chunks == 2
        assert a.lookup(tokens, session=sid("s-zero"), tails=True).hit_tokens == 69
        obj = retrieve(raw, "s-zero", 1, 2)[(1, 0)]
        raw.call("end_session", session=sid("s-zero"))
    per_layer = lay.blocks_per_chunk * lay.block_bytes
    for layer in range(lay.num_layers):
        part = obj[layer * per_layer : (layer + 1) * per_layer]
        assert part[: lay.block_bytes] == block_of("vllm_cpu", src[layer], 4).contiguous().numpy().tobytes()
        assert part[lay.block_bytes :] == bytes(per_layer - lay.block_bytes)


def test_no_tail_with_extra_keys_or_without_asking(kv_server) -> None:
    geo = Geometry("vllm_cpu")
    lay = geo.layout()
    src = geo.random_kv(24, seed=13)
    tokens = fresh_tokens(2 * 64 + 30)
    turn = np.concatenate([tokens, fresh_tokens(40)])
    with client(kv_server, [lay]) as a:
        assert a.register(src)
        assert a.save(tokens, list(range(10))).saved_chunks == 2  # no tail unless asked
        assert a.lookup(turn, tails=True).hit_tokens == 128
        extra = ((0, b"\x01" * 32),)
        assert a.save(tokens, list(range(10)), extra=extra, tail=True).saved_chunks == 2  # extra keys: no tail
        assert a.lookup(turn, extra=extra, tails=True).hit_tokens == 128
        assert a.save(tokens, list(range(10)), tail=True).saved_chunks == 1  # the tail alone is new
        assert a.lookup(turn, tails=True).hit_tokens == 158
