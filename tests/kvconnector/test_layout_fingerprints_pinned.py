"""Today's layout fingerprints, pinned. A fingerprint names what an object's bytes mean; objects
already in L1, in an fs or Redis L2 and in other servers of a fleet are found by it. Work on the
layout descriptor (GPU backends' layouts from vLLM's KVCacheLayout, hybrid groups) must leave these
unchanged, or every cache a user has becomes a miss on upgrade. A change here is deliberate, and
docs/layouts.md then says so.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvconnector import layouts as L
from kvprotocol import LayoutDescriptor

TINY = dict(num_layers=2, num_kv_heads=2, head_dim=32, block_size=32)  # the tests' tiny Llama
LLAMA_8B = dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)


def cases() -> dict[str, LayoutDescriptor]:
    out: dict[str, LayoutDescriptor] = {}
    for name, geometry in (("tiny", TINY), ("llama8b", LLAMA_8B)):
        for dtype in ("float32", "bfloat16", "float16"):
            out[f"vllm_cpu/{name}/{dtype}"] = L.vllm_cpu_layout(**geometry, dtype=dtype)
        out[f"flash_attn/{name}/bfloat16"] = L.flash_attn_layout(**geometry, dtype="bfloat16")
    base = L.vllm_cpu_layout(**TINY, dtype="float32")
    out["vllm_cpu/tiny/float32/stacked"] = L.vllm_cpu_layout(**TINY, dtype="float32", stacked=True)
    out["vllm_cpu/tiny/float32/isa"] = dataclasses.replace(base, variant="avx512")
    out["vllm_cpu/tiny/float32/sliding"] = dataclasses.replace(base, kind="sliding", window=128)
    out["vllm_cpu/tiny/float32/chunk512"] = L.vllm_cpu_layout(**TINY, dtype="float32", chunk_size=512)
    mla = L.mla_layout(num_layers=4, latent_dim=576, block_size=64, dtype="bfloat16", shared=True)
    out["mla/shared/bfloat16"] = dataclasses.replace(mla, variant="cpu_mla")
    return out


PINNED = {
    "vllm_cpu/tiny/float32": "28d8857472283537",
    "vllm_cpu/tiny/bfloat16": "006f3b000815d87e",
    "vllm_cpu/tiny/float16": "4b32a016d317e488",
    "flash_attn/tiny/bfloat16": "05b8370ae8ceac9a",
    "vllm_cpu/llama8b/float32": "50d775c4cae51faa",
    "vllm_cpu/llama8b/bfloat16": "95d07ebe65941d51",
    "vllm_cpu/llama8b/float16": "70a115967d787617",
    "flash_attn/llama8b/bfloat16": "fe6ef1c7749207dc",
    # stacked (one tensor for all layers) moves the same bytes per object: the same objects
    "vllm_cpu/tiny/float32/stacked": "28d8857472283537",
    "vllm_cpu/tiny/float32/isa": "8b1a124a1a87b6aa",
    "vllm_cpu/tiny/float32/sliding": "d4ccc125a7be9c1a",
    "vllm_cpu/tiny/float32/chunk512": "9fd985482b150a34",
    "mla/shared/bfloat16": "a231d9ef89e35fe6",
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_fingerprint_is_pinned(name: str) -> None:
    layout = cases()[name]
    assert layout.fingerprint == PINNED[name]
    assert LayoutDescriptor.from_wire(layout.to_wire()).fingerprint == PINNED[name]  # as the server sees it


def test_every_case_is_pinned() -> None:
    assert set(cases()) == set(PINNED)
