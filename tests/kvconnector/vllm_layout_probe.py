"""Run by the .venv-vllm interpreter: how vLLM itself describes and allocates each case's KV cache.

Reads a JSON list of cases (argv[1]) and prints, per case, vLLM's spec fields, the per-layer views
that `create_kv_cache_views` makes over one backing buffer (shape, element strides, byte offset,
dtype), the backend's name and the layouts its kernels accept. Backends whose module cannot be
imported on the CPU wheel (FlashInfer needs the flashinfer package, CUTLASS MLA needs CUDA) report
`importable: false`; the test then uses their documented layouts.
"""

from __future__ import annotations

import importlib
import json
import sys

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    KVQuantMode,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

BACKENDS = {
    "FLASH_ATTN": ("vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend"),
    "FLASHINFER": ("vllm.v1.attention.backends.flashinfer", "FlashInferBackend"),
    "TRITON_ATTN": ("vllm.v1.attention.backends.triton_attn", "TritonAttentionBackend"),
    "FLEX_ATTENTION": ("vllm.v1.attention.backends.flex_attention", "FlexAttentionBackend"),
    "CPU_ATTN": ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackend"),
    "FLASHMLA": ("vllm.v1.attention.backends.mla.flashmla", "FlashMLABackend"),
    "TRITON_MLA": ("vllm.v1.attention.backends.mla.triton_mla", "TritonMLABackend"),
    "CUTLASS_MLA": ("vllm.v1.attention.backends.mla.cutlass_mla", "CutlassMLABackend"),
    "CPU_MLA": ("vllm.v1.attention.backends.mla.cpu_mla", "CPUMLABackend"),
}
FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2")


def backend_info(name: str) -> dict:
    module, cls = BACKENDS[name]
    try:
        backend = getattr(importlib.import_module(module), cls)
    except Exception as exc:  # noqa: BLE001 - reported, the test falls back to documented layouts
        return {"importable": False, "why": f"{type(exc).__name__}: {exc}"[:200]}
    layouts = backend.supported_kv_cache_layouts()
    return {
        "importable": True,
        "name": backend.get_name(),
        "layouts": None if layouts is None else [lay.name for lay in layouts],
    }


def probe(case: dict) -> dict:
    fp8 = case["cache_dtype"] in FP8
    dtype = torch.uint8 if fp8 else getattr(torch, case["dtype"])
    common = dict(block_size=case["block_size"], dtype=dtype, page_size_padded=case.get("page_size_padded"))
    if fp8:
        common["kv_quant_mode"] = KVQuantMode.FP8_PER_TENSOR
    if case["mla"]:
        spec = MLAAttentionSpec(num_kv_heads=1, head_size=case["head_size"], **common)
    else:
        spec = FullAttentionSpec(num_kv_heads=case["heads"], head_size=case["head_size"], **common)
    layout = KVCacheLayout[case["order"]]
    layers, blocks = case["num_layers"], case["num_blocks"]
    strides = compute_layout_strides(spec, blocks, layers, layout)
    size = max(strides[0] * layers, strides[1] * blocks)
    tensor = KVCacheTensor(
        size=size, layers=[f"l{i}" for i in range(layers)], layer_stride=strides[0], block_stride=strides[1]
    )
    raw = torch.zeros(size, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, blocks, layout, tensor)
    return {
        "spec": {
            "class": type(spec).__name__,
            "block_size": spec.block_size,
            "num_kv_heads": spec.num_kv_heads,
            "head_size": spec.head_size,
            "head_size_v": spec.head_size_v,
            "dtype": str(spec.dtype),
            "kv_quant_mode": int(spec.kv_quant_mode),
            "num_head_slots": spec.num_head_slots,
            "state_content_bytes": spec.state_content_bytes,
            "tokens_per_state": int(spec.tokens_per_state),
            "page_size_bytes": spec.page_size_bytes,
        },
        "size": size,
        "views": [
            {
                "shape": list(v.shape),
                "stride": list(v.stride()),
                "offset": v.storage_offset() * v.element_size(),
                "dtype": str(v.dtype),
            }
            for v in views
        ],
        "backend": backend_info(case["backend"]),
    }


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    print("PROBE " + json.dumps({name: probe(case) for name, case in cases.items()}))
