"""Property test through a real kvserver: for random layouts, dtypes, block-id permutations, load
ranges, modes and copy paths, a load writes exactly the saved bytes into exactly the blocks of its
range and nothing else."""

from __future__ import annotations

import uuid

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_kv_helpers import TAGS, Geometry, block_of, module_server, untouched
from kvconnector.engine_client import EngineClient

CHUNK = 32
kv_server = module_server("--l1-size-gb", "0.1", "--chunk-size", str(CHUNK))
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@st.composite
def cases(draw: st.DrawFn) -> dict:
    geo = Geometry(
        draw(st.sampled_from(TAGS)),
        num_layers=draw(st.integers(1, 3)),
        heads=draw(st.integers(1, 3)),
        head_dim=draw(st.sampled_from((2, 4, 8))),
        block_size=draw(st.sampled_from((4, 8, 16, 32))),
        chunk_size=CHUNK,
        dtype=draw(st.sampled_from(DTYPES)),
    )
    n_tokens = draw(st.integers(CHUNK, 5 * CHUNK + CHUNK - 1))
    n_blocks = -(-n_tokens // geo.block_size)
    pool = n_blocks + draw(st.integers(0, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    hit = n_tokens // CHUNK * CHUNK
    skip = draw(st.integers(0, hit // geo.block_size)) * geo.block_size
    return {
        "geo": geo,
        "stacked": draw(st.booleans()),
        "mode": draw(st.sampled_from(("shm", "tcp"))),
        "backend": draw(st.sampled_from(("host", "torch"))),
        "tokens": rng.integers(0, 1 << 31, n_tokens),
        "src_ids": [int(b) for b in rng.permutation(pool)[:n_blocks]],
        "dst_ids": [int(b) for b in rng.permutation(pool)[:n_blocks]],
        "pool": pool,
        "hit": hit,
        "skip": skip,
        "num": draw(st.integers(skip, hit)),
        "seed": int(rng.integers(1 << 30)),
    }


@settings(max_examples=30, deadline=None)
@given(case=cases())
def test_load_writes_exactly_the_range(kv_server, case: dict) -> None:
    geo: Geometry = case["geo"]
    lay = geo.layout(stacked=case["stacked"])
    src, dst = geo.random_kv(case["pool"], case["seed"]), geo.sentinel_kv(case["pool"])
    if case["stacked"]:
        src, dst = torch.stack(src), torch.stack(dst)
    salt = uuid.uuid4().hex  # examples must not see each other's objects
    kw = {"mode": case["mode"], "copy_backend": case["backend"]}
    with (
        EngineClient(kv_server.url, "prop/model", 1, 0, [lay], **kw) as a,
        EngineClient(kv_server.url, "prop/model", 1, 0, [lay], **kw) as b,
    ):
        assert a.register(src) and b.register(dst)
        saved = a.save(case["tokens"], case["src_ids"], salt=salt)
        assert saved.ok and saved.saved_chunks == case["hit"] // CHUNK, saved
        assert b.lookup(case["tokens"], salt=salt, session=salt).hit_tokens == case["hit"]
        res = b.load(salt, case["tokens"], case["dst_ids"], case["skip"], case["num"], salt=salt)
        assert res.ok and res.loaded_tokens == case["num"] - case["skip"], res
        b.release(salt)
    lo, hi = case["skip"] // geo.block_size, -(-case["num"] // geo.block_size)
    written = {case["dst_ids"][j]: case["src_ids"][j] for j in range(lo, hi)}
    for layer in range(geo.num_layers):
        for blk in range(case["pool"]):
            if blk in written:  # randn never yields NaN or -0.0, so equal values mean equal bytes
                assert torch.equal(block_of(geo.tag, dst[layer], blk), block_of(geo.tag, src[layer], written[blk]))
            else:
                assert untouched(geo.tag, dst[layer], blk)
