"""EngineClient against a real kvserver: exact bytes through save and load, for every layout tag, both
data-plane modes and both copy paths; untouched blocks; lookup, save and load semantics."""

from __future__ import annotations
from kvtestkit.kvhelpers import sid

import itertools

import numpy as np
import pytest
import torch

from engine_kv_helpers import TAGS, Geometry, block_of, module_server, untouched
from kvconnector.engine_client import EngineClient, LoadResult, LookupResult, SaveResult
from kvconnector.layouts import mla_layout, vllm_cpu_layout
from kvprotocol import KeySpace, pack_tokens

kv_server = module_server("--l1-size-gb", "0.1", "--chunk-size", "64", "--lease-ttl", "30")
_seeds = itertools.count(1)


def fresh_tokens(n: int) -> np.ndarray:
    """Tokens no other test uses, so every test sees a cold cache."""
    return np.random.default_rng(next(_seeds) * 7919).integers(0, 50_000, n)


def client(server, layouts, mode: str = "auto", **kw) -> EngineClient:
    return EngineClient(server.url, "test/model", 1, 0, layouts, mode=mode, **kw)


@pytest.mark.parametrize("backend", ["host", "torch"])
@pytest.mark.parametrize("mode", ["shm", "tcp"])
@pytest.mark.parametrize("tag", TAGS)
def test_save_then_load_into_other_blocks_is_exact(kv_server, tag: str, mode: str, backend: str) -> None:
    geo = Geometry(tag)
    lay = geo.layout()
    src, dst = geo.random_kv(24, seed=1), geo.sentinel_kv(30)
    tokens = fresh_tokens(4 * 64 + 10)  # four full chunks and a tail
    src_ids = list(range(3, 3 + 17))  # 17 blocks of 16 tokens cover 272 tokens
    dst_ids = list(np.random.default_rng(5).permutation(30)[:17])
    with (
        client(kv_server, [lay], mode, copy_backend=backend) as a,
        client(kv_server, [lay], mode, copy_backend=backend) as b,
    ):
        assert a.register(src) and b.register(dst)
        assert a.data_mode == mode
        saved = a.save(tokens, src_ids)
        assert saved == SaveResult(True, 4, None, 4)
        hit = b.lookup(tokens, session=sid("s-exact"))
        assert hit == LookupResult(256, None)
        # the engine already holds 2 blocks (32 tokens); load up to 250 tokens (not chunk-aligned)
        res = b.load(sid("s-exact"), tokens, dst_ids, skip_tokens=32, num_tokens=250)
        assert res == LoadResult(True, 218, [], None)
        b.release(sid("s-exact"))
    written = range(2, 16)  # blocks [32/16, ceil(250/16))
    for layer in range(geo.num_layers):
        for j, d in enumerate(dst_ids):
            if j in written:
                assert torch.equal(block_of(tag, dst[layer], d), block_of(tag, src[layer], src_ids[j])), (layer, j)
        touched = {dst_ids[j] for j in written}
        for blk in range(30):
            if blk not in touched:
                assert untouched(tag, dst[layer], blk), (layer, blk)


@pytest.mark.parametrize("mode", ["shm", "tcp"])
def test_stacked_cache_and_chunk_aligned_full_load(kv_server, mode: str) -> None:
    geo = Geometry("vllm_cpu", num_layers=3)
    lay = geo.layout(stacked=True)
    src = torch.stack(geo.random_kv(12, seed=2))
    dst = torch.stack(geo.sentinel_kv(12))
    tokens = fresh_tokens(128)
    with client(kv_server, [lay], mode) as a, client(kv_server, [lay], mode) as b:
        assert a.register(src) and b.register(dst)
        assert a.save(torch.tensor(tokens), list(range(8))).saved_chunks == 2  # tokens as a torch tensor
        assert b.lookup(tokens.tolist(), session=sid("s-stacked")).hit_tokens == 128
        ids = [11, 10, 9, 8, 7, 6, 5, 4]
        assert b.load(sid("s-stacked"), tokens, ids, 0, 128).ok
    for j, d in enumerate(ids):
        assert torch.equal(dst[:, d], src[:, j])
    assert all(untouched("vllm_cpu", dst[layer], blk) for layer in range(3) for blk in range(4))


def test_lookup_needs_no_registration_and_counts_whole_prefix_chunks(kv_server) -> None:
    geo = Geometry("mla")
    lay = geo.layout()
    tokens = fresh_tokens(64 * 3 + 5)
    with client(kv_server, [lay]) as worker, client(kv_server, [lay]) as scheduler:
        assert scheduler.lookup(tokens) == LookupResult(0, None)
        worker.register(geo.random_kv(16, seed=3))
        assert worker.save(tokens[:130], list(range(16))).saved_chunks == 2  # only full chunks of 130 tokens
        assert scheduler.lookup(tokens).hit_tokens == 128
        assert scheduler.lookup(tokens, salt="tenant-b").hit_tokens == 0  # salts isolate tenants
        other = tokens.copy()
        other[5] += 1  # a change in chunk 0 changes every later chunk's key
        assert scheduler.lookup(other).hit_tokens == 0
        assert scheduler.data_mode is None  # it never registered nor mapped anything


def test_save_skip_tokens_and_short_block_tables(kv_server) -> None:
    geo = Geometry("vllm_cpu")
    lay = geo.layout()
    tokens = fresh_tokens(64 * 4)
    ks = KeySpace.from_layouts("test/model", 1, [lay])
    with client(kv_server, [lay]) as c, kv_server.client() as raw:
        c.register(geo.random_kv(20, seed=4))
        assert c.data_mode == "shm"  # auto: the server is on this host and its arena is visible
        # blocks for only 2.5 chunks: chunk 2 is not fully covered, so only chunk 1 is written
        res = c.save(tokens, list(range(10)), skip_tokens=64)
        assert res == SaveResult(True, 1, None, 1)
        chunks = raw.call("query", keyspace=ks.to_wire(), tokens=pack_tokens(tokens)).result["chunks"]
        assert [ch["l1"] for ch in chunks] == [0, 1, 0, 0]
        assert c.lookup(tokens).hit_tokens == 0  # a hole at chunk 0 ends the prefix
        assert c.save(tokens, list(range(16))) == SaveResult(True, 3, None, 4)  # chunk 1 was already there
        assert c.save(tokens, list(range(16))) == SaveResult(True, 0, None, 4)
        assert c.lookup(tokens).hit_tokens == 256


def test_load_leases_again_when_the_session_is_unknown(kv_server) -> None:
    geo = Geometry("flash_attn")
    lay = geo.layout()
    src, dst = geo.random_kv(8, seed=5), geo.sentinel_kv(8)
    tokens = fresh_tokens(64)
    with client(kv_server, [lay]) as a, client(kv_server, [lay]) as b:
        a.register(src)
        b.register(dst)
        assert a.save(tokens, [0, 1, 2, 3]).ok
        res = b.load(sid("never-looked-up"), tokens, [4, 5, 6, 7], 0, 64)  # the worker leases it itself
        assert res.ok and res.loaded_tokens == 64
        assert torch.equal(block_of("flash_attn", dst[1], 6), block_of("flash_attn", src[1], 2))
        miss = b.load(sid("other"), fresh_tokens(64), [4, 5, 6, 7], 0, 64)  # not cached: nothing to lease
        assert not miss.ok and miss.failed_block_ids == [4, 5, 6, 7] and "NOT_LEASED" in (miss.error or "")


def test_load_rejects_bad_requests_without_touching_blocks(kv_server) -> None:
    geo = Geometry("vllm_cpu")
    lay = geo.layout()
    dst = geo.sentinel_kv(8)
    tokens = fresh_tokens(128)
    with client(kv_server, [lay]) as a, client(kv_server, [lay]) as b:
        assert not b.load(sid("s"), tokens, [0, 1, 2, 3], 0, 64).ok  # before register
        a.register(geo.random_kv(8, seed=6))
        assert a.save(tokens, list(range(8))).ok
        b.register(dst)
        b.lookup(tokens, session=sid("s-bad"))
        cases = {
            "unaligned skip": b.load(sid("s-bad"), tokens, list(range(8)), 8, 64),
            "short table": b.load(sid("s-bad"), tokens, [0, 1], 0, 64),
            "block out of range": b.load(sid("s-bad"), tokens, [0, 1, 2, 99], 0, 64),
            "block twice": b.load(sid("s-bad"), tokens, [0, 1, 1, 2], 0, 64),
            "beyond the leased prefix": b.load(sid("s-bad"), tokens, list(range(12)), 0, 192),
            "bad salt": b.load(sid("s-bad"), tokens, list(range(8)), 0, 64, salt="no spaces"),
        }
        for name, res in cases.items():
            assert not res.ok and res.loaded_tokens == 0 and res.error, name
        assert cases["unaligned skip"].failed_block_ids == [1, 2, 3]
        assert cases["unaligned skip"].error.startswith("invalid")
        assert all(untouched("vllm_cpu", dst[layer], blk) for layer in range(2) for blk in range(8))
        assert b.load(sid("s-bad"), tokens, list(range(8)), 64, 64) == LoadResult(True, 0, [], None)  # empty range


def test_register_rejects_tensors_that_do_not_match_the_layout(kv_server) -> None:
    geo = Geometry("vllm_cpu")
    with client(kv_server, [geo.layout()]) as c:
        assert not c.register([torch.zeros(4, 2, 16, 16)])  # one layer for a 2-layer layout
        assert not c.register(Geometry("vllm_cpu", head_dim=4).random_kv(4, seed=0))
        assert not c.register(geo.random_kv(4, seed=0)[0].to(torch.float16).unsqueeze(0).expand(2, -1, -1, -1, -1))
        res = c.save(fresh_tokens(64), [0, 1, 2, 3])
        assert not res.ok and "register" in (res.error or "")
        assert c.register(geo.random_kv(4, seed=0))


def test_two_object_groups_with_their_own_block_tables(kv_server) -> None:
    layouts = [
        vllm_cpu_layout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=32, dtype=torch.float32, chunk_size=64),
        mla_layout(num_layers=1, latent_dim=8, block_size=16, dtype=torch.float32, chunk_size=64),
    ]
    g0, g1 = Geometry("vllm_cpu", 2, 1, 4, 32), Geometry("mla", 1, 1, 8, 16)
    src, dst = [g0.random_kv(6, 7), g1.random_kv(10, 8)], [g0.sentinel_kv(6), g1.sentinel_kv(10)]
    tokens = fresh_tokens(128)
    tables_a = [[0, 1, 2, 3], list(range(8))]
    tables_b = [[5, 4, 3, 2], [9, 8, 7, 6, 5, 4, 3, 2]]
    with client(kv_server, layouts, "shm") as a, client(kv_server, layouts, "tcp") as b:
        assert a.register(src) and b.register(dst)
        assert a.save(tokens, tables_a) == SaveResult(True, 2, None, 2)
        assert b.lookup(tokens, session=sid("s-groups")).hit_tokens == 128
        assert b.load(sid("s-groups"), tokens, tables_b, 64, 128).ok
    for layer in range(2):
        for j in (2, 3):
            assert torch.equal(dst[0][layer][tables_b[0][j]], src[0][layer][tables_a[0][j]])
        assert untouched("vllm_cpu", dst[0][layer], 5) and untouched("vllm_cpu", dst[0][layer], 4)
    for j in range(4, 8):
        assert torch.equal(dst[1][0][tables_b[1][j]], src[1][0][tables_a[1][j]])
    assert all(untouched("mla", dst[1][0], tables_b[1][j]) for j in range(4))


def test_save_reports_no_space(server_factory) -> None:
    server = server_factory("--l1-size-gb", "0.001", "--chunk-size", "64")  # 1 MiB
    geo = Geometry("vllm_cpu", num_layers=4, heads=2, head_dim=64)  # 256 KiB objects: four fit
    with client(server, [geo.layout()]) as c:
        c.register(geo.random_kv(48, seed=9))
        res = c.save(fresh_tokens(64 * 6), list(range(48)))
        assert not res.ok and res.no_space and "NO_SPACE" in (res.error or "")
        assert res.saved_chunks == 4 and res.cached_chunks == 4
        assert c.lookup(fresh_tokens(1)).error is None  # the server keeps serving
