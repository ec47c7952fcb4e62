"""Every vLLM 0.32 attention backend's KV cache as vLLM allocates it, and a byte round trip of it
through a real kvserver: shared by the layout-reader tests (CPU tensors) and bench/gpu_check.py
(the same cases on a GPU).

Each case's KV is one int8 buffer laid out in the case's KVCacheLayout over [L, B, H, N, C bytes]
(vLLM's `compute_layout_strides`), viewed per layer as [B, H, N, C] of the cache dtype
(`create_kv_cache_views`); tests/kvconnector/test_layout_reader.py proves `vllm_views` against
vLLM's own functions.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvconnector.engine_client import EngineClient
from kvconnector.layout_reader import KV_CACHE_LAYOUTS, ReadLayout, read_layout
from kvprotocol import new_session_id

SCALES = [(0.5, 0.25), (1.0, 2.0)]  # per-layer (k_scale, v_scale) of the fp8 cases
GQA = dict(heads=2, head_size=16, block_size=16)
MLA = dict(heads=1, head_size=72, block_size=16, mla=True)

# name: (backend, order, dtype, cache_dtype, geometry)
CASES: dict[str, dict[str, Any]] = {
    "flash_attn/LBNHC/bf16": dict(backend="FLASH_ATTN", order="LBNHC", dtype="bfloat16", **GQA),
    "flash_attn/BLNHC/fp16": dict(backend="FLASH_ATTN", order="BLNHC", dtype="float16", **GQA),
    "flash_attn/LBNHC/fp8_e4m3": dict(backend="FLASH_ATTN", order="LBNHC", dtype="bfloat16", cache_dtype="fp8", **GQA),
    "flashinfer/NHD/fp16": dict(backend="FLASHINFER", order="LBNHC", dtype="float16", **GQA),
    "flashinfer/HND/bf16": dict(backend="FLASHINFER", order="LBHNC", dtype="bfloat16", **GQA),
    "flashinfer/BLHNC/fp8_e5m2": dict(
        backend="FLASHINFER", order="BLHNC", dtype="bfloat16", cache_dtype="fp8_e5m2", **GQA
    ),
    "triton/LBNHC/bf16": dict(backend="TRITON_ATTN", order="LBNHC", dtype="bfloat16", **GQA),
    "flex/LBNHC/fp16": dict(backend="FLEX_ATTENTION", order="LBNHC", dtype="float16", **GQA),
    "cpu/LBHNC/bf16": dict(backend="CPU_ATTN", order="LBHNC", dtype="bfloat16", variant="vec", **GQA),
    "flashmla/LBNHC/bf16": dict(backend="FLASHMLA", order="LBNHC", dtype="bfloat16", **MLA),
    "triton_mla/BLNHC/fp8_e4m3": dict(
        backend="TRITON_MLA", order="BLNHC", dtype="bfloat16", cache_dtype="fp8_e4m3", **MLA
    ),
    "cutlass_mla/LBHNC/fp16": dict(backend="CUTLASS_MLA", order="LBHNC", dtype="float16", **MLA),
    "cpu_mla/LBNHC/bf16": dict(backend="CPU_MLA", order="LBNHC", dtype="bfloat16", variant="cpu_mla", **MLA),
    "flash_attn/LBNHC/bf16/padded": dict(
        backend="FLASH_ATTN", order="LBNHC", dtype="bfloat16", page_size_padded=2 * 16 * 2 * 16 * 2 + 512, **GQA
    ),
}
NUM_LAYERS, NUM_BLOCKS, CHUNK = 2, 24, 64
_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def case(name: str) -> dict[str, Any]:
    c = dict(CASES[name])
    c.setdefault("cache_dtype", "auto")
    c.setdefault("mla", False)
    c.update(num_layers=NUM_LAYERS, num_blocks=NUM_BLOCKS)
    return c


def read(name: str, **overrides: Any) -> ReadLayout:
    c = {**case(name), **overrides}
    return read_layout(
        order=c["order"],
        backend=c["backend"],
        num_layers=c["num_layers"],
        block_size=c["block_size"],
        num_kv_heads=c["heads"],
        head_size=c["head_size"],
        head_size_v=0 if c["mla"] else c["head_size"],
        spec_dtype="uint8" if c["cache_dtype"] != "auto" else c["dtype"],
        cache_dtype=c["cache_dtype"],
        mla=c["mla"],
        kv_quant_mode=1 if c["cache_dtype"] != "auto" else 0,
        kv_scales=SCALES if c["cache_dtype"] != "auto" else None,
        chunk_size=CHUNK,
        variant=c.get("variant", ""),
    )


def vllm_views(name: str, seed: int, device: Any = "cpu") -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(backing int8 buffer of random bytes, per-layer [B, H, N, C] views), as vLLM allocates them."""
    c = case(name)
    item = 1 if c["cache_dtype"] != "auto" else torch.empty(0, dtype=getattr(torch, c["dtype"])).element_size()
    content = (1 if c["mla"] else 2) * c["head_size"] * item
    shape = (c["num_layers"], c["num_blocks"], c["heads"], c["block_size"], content)
    order = KV_CACHE_LAYOUTS[c["order"]]
    padded = c.get("page_size_padded")
    grid_end = max(order.index(0), order.index(1)) + 1
    strides, cur = [0] * 5, 1
    for physical, dim in reversed(list(enumerate(order))):  # vllm.v1.kv_cache_interface.compute_layout_strides
        if padded is not None and physical == grid_end - 1:
            cur = max(cur, padded)
        strides[dim] = cur
        cur = strides[dim] * shape[dim]
    raw = torch.randint(-128, 128, (cur,), dtype=torch.int8, generator=torch.Generator().manual_seed(seed)).to(device)
    view = torch.as_strided(raw, shape, strides)
    dtype = _FP8.get(c["cache_dtype"], getattr(torch, c["dtype"]))
    return raw, [view[i].view(dtype) for i in range(c["num_layers"])]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def round_trip(url: str, src_name: str, dst_name: str, backend: str, seed: int, device: Any = "cpu") -> dict[str, Any]:
    """Save 8 blocks of `src_name`'s engine, load them into other blocks of `dst_name`'s engine through
    the server at `url` (shm, `backend` copier), compare bytes. Returns what happened: `loaded` tokens,
    `equal` (every loaded block is the saved one, bitwise), `untouched` (every other byte of the
    destination buffer, padding and other layers included, kept its value), or `error`."""
    rs, rd = read(src_name), read(dst_name)
    if rs.layout.fingerprint != rd.layout.fingerprint:
        return {"error": "the two engines' layouts differ"}
    _, src = vllm_views(src_name, seed, device)
    dst_raw, dst = vllm_views(dst_name, seed + 1, device)
    before = dst_raw.clone()
    tokens = np.random.default_rng(seed).integers(0, 50_000, 2 * CHUNK + 5)
    src_ids = [5, 6, 7, 8, 20, 21, 22, 23]
    dst_ids = [int(b) for b in np.random.default_rng(seed).permutation(NUM_BLOCKS)[:8]]
    kw: dict[str, Any] = dict(mode="shm", timeout=30, copy_backend=backend)
    model = f"reader/{src_name}/{seed}"
    session = new_session_id()
    with EngineClient(url, model, 1, 0, [rs.layout], **kw) as a, EngineClient(url, model, 1, 0, [rd.layout], **kw) as b:
        if not (a.register([rs.engine_view(t) for t in src]) and b.register([rd.engine_view(t) for t in dst])):
            return {"error": "register failed"}
        saved = a.save(tokens, src_ids)
        if saved.saved_chunks != 2:
            return {"error": f"save stored {saved.saved_chunks} of 2 chunks"}
        hit = b.lookup(tokens, session=session)
        if hit.hit_tokens != 2 * CHUNK:
            return {"error": f"lookup hit {hit.hit_tokens} of {2 * CHUNK} tokens"}
        res = b.load(session, tokens, dst_ids, skip_tokens=0, num_tokens=2 * CHUNK)
        b.release(session)
        if not res.ok:
            return {"error": f"load failed: {res}"}
    equal = all(
        torch.equal(as_bytes(dst[layer][d]), as_bytes(src[layer][s]))
        for layer in range(NUM_LAYERS)
        for s, d in zip(src_ids, dst_ids, strict=True)
    )
    mask = torch.ones(dst_raw.numel(), dtype=torch.bool, device=dst_raw.device)
    for layer in range(NUM_LAYERS):
        for d in dst_ids:
            blk = dst[layer][d]
            lo = blk.storage_offset() * blk.element_size()
            span = (sum((n - 1) * st for n, st in zip(blk.shape, blk.stride(), strict=True)) + 1) * blk.element_size()
            mask[lo : lo + span] = False
    untouched = bool(torch.equal(dst_raw[mask], before[mask]))
    shape, strides = tuple(src[0].shape), tuple(src[0].stride())
    return {"loaded": res.loaded_tokens, "equal": equal, "untouched": untouched, "shape": shape, "strides": strides}
