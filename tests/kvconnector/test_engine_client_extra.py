"""EngineClient's per-chunk extra keys against a real kvserver: what was saved under one extra key is
never found or loaded under another, and the load's re-lookup path carries them too."""

from __future__ import annotations
from kvtestkit.kvhelpers import sid

import numpy as np
import torch
from blake3 import blake3

from engine_kv_helpers import Geometry, block_of, module_server
from kvconnector.engine_client import EngineClient

kv_server = module_server("--l1-size-gb", "0.1", "--chunk-size", "64", "--lease-ttl", "30")
A, B = blake3(b"lora:a").digest(), blake3(b"lora:b").digest()


def test_extra_keys_separate_saves_and_reach_the_reload_path(kv_server) -> None:
    geo = Geometry("vllm_cpu")
    lay = geo.layout()
    src, dst = geo.random_kv(24, seed=3), geo.sentinel_kv(24)
    tokens = np.random.default_rng(77).integers(0, 50_000, 4 * 64)
    ids = list(range(16))
    xa = [(i, A) for i in range(4)] + [(9, A)]  # keys past the last chunk are dropped, not sent
    with EngineClient(kv_server.url, "m", 1, 0, [lay]) as a, EngineClient(kv_server.url, "m", 1, 0, [lay]) as b:
        assert a.register(src) and b.register(dst)
        assert a.save(tokens, ids, extra=xa).saved_chunks == 4
        assert b.lookup(tokens).hit_tokens == 0  # plain request: other objects
        assert b.lookup(tokens, extra=[(i, B) for i in range(4)]).hit_tokens == 0  # another adapter
        assert b.lookup(tokens, extra=[(0, A), (1, A)]).hit_tokens == 128  # chunk 2 differs
        assert b.lookup(tokens, extra=xa).hit_tokens == 256
        # no lookup under this session: the load's re-lookup (with the extra keys) takes the leases
        res = b.load(sid("s-relookup"), tokens, ids, 0, 256, extra=xa)
        assert res.ok and res.loaded_tokens == 256
        b.release(sid("s-relookup"))
        bad = b.load(sid("s-other"), tokens, ids, 0, 256, extra=[(i, B) for i in range(4)])
        assert not bad.ok and bad.failed_block_ids == ids
    for j in ids:
        assert torch.equal(block_of("vllm_cpu", dst[0], j), block_of("vllm_cpu", src[0], j))
