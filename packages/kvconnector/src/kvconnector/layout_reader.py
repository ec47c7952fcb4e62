"""One reader for every vLLM attention backend's KV cache: the LayoutDescriptor from vLLM's own description.

Why: vLLM (0.32 on) describes each layer's cache as a logical [B, H, N, C] view (blocks, head slots,
tokens, content bytes: K then V of one head and token) of a buffer laid out in one of six physical
orders over [L, B, H, N, C] (`vllm.v1.kv_cache_layout.KVCacheLayout`, resolved once per engine and
recorded in `KVCacheConfig.kv_cache_layout`). Backends differ only in that order and in the spec
(head size, dtype, quantisation); this module turns (spec, order) into the descriptor, so the
scheduler (spec only) and the worker (tensors) name objects identically, on any device.

What an object's block holds is the block's interior in physical order, minus any padding between
blocks. So the descriptor's tag names the interior order, not the backend:
  vllm_cpu  [H, N, C] packed by vLLM's CPU attention (the ISA is the variant; unchanged fingerprints)
  vllm_hnd  [H, N, C] (LBHNC, BLHNC: FlashInfer HND, the default of Blackwell kernels)
  vllm_nhd  [N, H, C] (LBNHC, BLNHC: FlashAttention, Triton, FlexAttention, FlashInfer NHD)
  mla       [N, latent] (one latent per token; every TP rank holds the same: `shared`)
Two backends whose blocks hold the same bytes (FlashAttention and Triton under LBNHC) therefore share
objects; an order that splits a block into per-head pieces (LHBNC, BHLNC) is refused.

fp8: vLLM stores fp8 KV as uint8 and keeps one k_scale and one v_scale per layer on the attention
module. A byte means scale * value, so the scales decide what the bytes mean exactly as the dtype
does: they go into the fingerprint (`LayoutDescriptor.scales`, a digest of every layer's pair), and an
fp8 layout without them is refused. The object itself stays plain bytes: a reader under other
scales then misses instead of fetching an object it must reject.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

from blake3 import blake3
from kvprotocol import DEFAULT_CHUNK_SIZE, DTYPES, LayoutDescriptor

if TYPE_CHECKING:  # never imported at run time: the scheduler side's tests run without vLLM
    import torch
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout

# vllm.v1.kv_cache_layout.KVCacheLayout: physical order of the logical axes [L, B, H, N, C]
KV_CACHE_LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
LEGACY_LAYOUT_NAMES = {"NHD": "LBNHC", "HND": "LBHNC"}  # vLLM's aliases (VLLM_KV_CACHE_LAYOUT)
_H, _N = 2, 3

# Backends whose blocks we can describe (vLLM's get_name()), and the orders their kernels accept (None: any).
ATTENTION_BACKENDS: dict[str, tuple[str, ...] | None] = {
    "FLASH_ATTN": None,
    "FLASHINFER": None,
    "TRITON_ATTN": None,
    "FLEX_ATTENTION": ("LBNHC",),
    "CPU_ATTN": ("LBHNC",),
}
MLA_BACKENDS = ("FLASHMLA", "TRITON_MLA", "CUTLASS_MLA", "FLASHINFER_MLA", "FLASH_ATTN_MLA", "CPU_MLA", "AMX_MLA")
CPU_BACKENDS = ("CPU_ATTN", "CPU_MLA", "AMX_MLA")  # they pack blocks their own way: the variant says how

# vLLM's cache_dtype strings whose bytes we can name; others (fp8_ds_mla, per-token-head, int4) are refused.
_FP8 = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
_PLAIN = {"float32", "float16", "bfloat16", "half", "float"}


class UnreadableLayout(ValueError):
    """vLLM's description names a cache whose block bytes this reader cannot describe."""


@dataclass(frozen=True, slots=True)
class ReadLayout:
    """The descriptor, and how to turn vLLM's per-layer [B, H, N, C] views into the tag's physical view."""

    layout: LayoutDescriptor
    order: str  # the KVCacheLayout name
    head_major: bool  # H before N inside a block

    def engine_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """vLLM's logical [B, H, N, C] per-layer view (torch) as [B, <interior in physical order>] of
        the descriptor's dtype: no copy, the same bytes."""
        if tuple(tensor.shape[1:]) != self.logical_interior:
            raise UnreadableLayout(
                f"KV view has shape {tuple(tensor.shape)}, the layout expects [B, {self.logical_interior}]"
            )
        if self.layout.tag == "mla":
            t = tensor.select(1, 0)
        elif self.head_major:
            t = tensor
        else:
            t = tensor.transpose(1, 2)
        import torch  # only callers with tensors get here

        want = getattr(torch, self.layout.dtype)
        if t.dtype != want:
            if t.element_size() != want.itemsize:
                raise UnreadableLayout(f"KV view dtype {t.dtype} cannot hold {self.layout.dtype}")
            t = t.view(want)
        return t

    @property
    def logical_interior(self) -> tuple[int, int, int]:
        """(H, N, C in elements) of vLLM's logical per-layer view."""
        shape = self.layout.block_shape
        if self.layout.tag == "mla":
            return (1, shape[0], shape[1])
        if self.head_major:
            return (shape[0], shape[1], shape[2])
        return (shape[1], shape[0], shape[2])


def layout_name(name: str | KVCacheLayout) -> str:
    """A KVCacheLayout member, its name, or a legacy alias (NHD/HND), as the canonical name."""
    text = str(getattr(name, "name", name)).upper().removeprefix("KVCACHELAYOUT.")
    text = LEGACY_LAYOUT_NAMES.get(text, text)
    if text not in KV_CACHE_LAYOUTS:
        raise UnreadableLayout(f"unknown KV cache layout {name!r}; known: {sorted(KV_CACHE_LAYOUTS)}")
    return text


def kv_dtype(cache_dtype: str, spec_dtype: str) -> str:
    """The descriptor dtype: vLLM's cache_dtype string decides (its fp8 caches are typed uint8)."""
    cache_dtype = str(cache_dtype)
    if cache_dtype in _FP8:
        return _FP8[cache_dtype]
    if cache_dtype not in ("auto", *_PLAIN):
        raise UnreadableLayout(f"KV cache dtype {cache_dtype!r} is not supported (bf16, fp16, fp32, fp8 e4m3/e5m2)")
    name = str(spec_dtype).removeprefix("torch.")
    name = {"half": "float16", "float": "float32"}.get(name, name)
    if name not in _PLAIN:
        raise UnreadableLayout(f"KV dtype {spec_dtype!r} is not supported")
    return name


def scales_digest(scales: Sequence[tuple[float, float]]) -> str:
    """16 hex chars naming every layer's (k_scale, v_scale), bit-exact (float64)."""
    h = blake3(b"kv-fp8-scales-v1")
    for k, v in scales:
        h.update(struct.pack("<dd", float(k), float(v)))
    return h.hexdigest()[:16]


def read_layout(
    *,
    order: str | KVCacheLayout,
    backend: str,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    head_size_v: int | None = None,
    spec_dtype: str,
    cache_dtype: str = "auto",
    mla: bool = False,
    kv_quant_mode: int = 0,
    num_head_slots: int | None = None,
    state_content_bytes: int | None = None,
    tokens_per_state: int | Fraction = 1,
    kv_scales: Sequence[tuple[float, float]] | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    variant: str = "",
) -> ReadLayout:
    """The descriptor of one KV cache group from vLLM's description of it (UnreadableLayout if none).

    `order` is the resolved KVCacheLayout; `backend` vLLM's attention backend name; the other fields
    are the group's AttentionSpec's. `variant` is what else packs a block (the CPU attention ISA or
    MLA backend). `kv_scales`: every layer's (k_scale, v_scale), required for fp8."""
    name = layout_name(order)
    backend = str(backend).upper()
    known = MLA_BACKENDS if mla else tuple(ATTENTION_BACKENDS)
    if backend not in known:
        raise UnreadableLayout(f"attention backend {backend} is not one whose blocks we can describe ({known})")
    accepted = None if mla else ATTENTION_BACKENDS[backend]
    if accepted is not None and name not in accepted:
        raise UnreadableLayout(f"{backend} does not use the {name} layout (it uses {accepted})")
    perm = KV_CACHE_LAYOUTS[name]
    if set(perm[:2]) != {0, 1}:
        raise UnreadableLayout(f"KV cache layout {name} splits a block into per-head pieces; use LBHNC or LBNHC")
    if kv_quant_mode not in (0, 1) or num_head_slots is not None or state_content_bytes is not None:
        raise UnreadableLayout("packed or per-token quantised KV content is not supported")
    if tokens_per_state != 1:
        raise UnreadableLayout("compressed KV states (more or fewer than one per token) are not supported")
    dtype = kv_dtype(cache_dtype, spec_dtype)
    digest = ""
    if dtype.startswith("float8"):
        if kv_scales is None or len(kv_scales) != num_layers:
            raise UnreadableLayout("fp8 KV needs every layer's k_scale and v_scale (they are part of the fingerprint)")
        digest = scales_digest(kv_scales)
    head_major = perm[2:4] == (_H, _N)
    shared = False
    shape: tuple[int, ...]
    if mla:
        if num_kv_heads != 1 or head_size_v not in (None, 0):
            raise UnreadableLayout("an MLA cache must hold one latent per token")
        tag, shape, shared = "mla", (block_size, head_size), True
    else:
        if head_size_v not in (None, head_size):
            raise UnreadableLayout("different K and V head sizes are not supported")
        if backend in CPU_BACKENDS:
            tag = "vllm_cpu"
        else:
            tag = "vllm_hnd" if head_major else "vllm_nhd"
        inner = (num_kv_heads, block_size) if head_major else (block_size, num_kv_heads)
        shape = (*inner, 2 * head_size)
    if backend in CPU_BACKENDS and not variant:
        raise UnreadableLayout(f"{backend} packs blocks per CPU ISA: the variant is required")
    layout = LayoutDescriptor(
        tag=tag,
        dtype=dtype,
        num_layers=num_layers,
        block_size=block_size,
        block_bytes=math.prod(shape) * DTYPES[dtype],
        chunk_size=chunk_size,
        block_shape=tuple(int(d) for d in shape),
        variant=variant,
        shared=shared,
        scales=digest,
    )
    return ReadLayout(layout, name, head_major)


def read_spec_layout(
    spec: AttentionSpec,
    *,
    order: str | KVCacheLayout,
    backend: str,
    num_layers: int,
    cache_dtype: str = "auto",
    kv_scales: Sequence[tuple[float, float]] | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    variant: str = "",
) -> ReadLayout:
    """`read_layout` from a vLLM AttentionSpec / MLAAttentionSpec (read by attribute; vLLM not imported)."""
    return read_layout(
        order=order,
        backend=backend,
        num_layers=num_layers,
        block_size=int(spec.block_size),
        num_kv_heads=int(spec.num_kv_heads),
        head_size=int(spec.head_size),
        head_size_v=getattr(spec, "head_size_v", None),
        spec_dtype=str(spec.dtype),
        cache_dtype=cache_dtype,
        mla=type(spec).__name__ == "MLAAttentionSpec",
        kv_quant_mode=int(getattr(spec, "kv_quant_mode", 0) or 0),
        num_head_slots=getattr(spec, "num_head_slots", None),
        state_content_bytes=getattr(spec, "state_content_bytes", None),
        tokens_per_state=getattr(spec, "tokens_per_state", 1),
        kv_scales=kv_scales,
        chunk_size=chunk_size,
        variant=variant,
    )
