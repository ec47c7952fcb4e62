"""Layout descriptors for the engine KV layouts we support, built from shapes or from tensors.

Why: the `LayoutDescriptor` names what the bytes of a cached object mean (its fingerprint is part of
every object key), so it must be derived the same way by every engine process. These constructors
are the one place that maps an engine's tensor geometry to (tag, dtype, block_bytes, block_shape).

Per-layer tensor shapes (one tensor per layer; `stacked=True` adds a leading num_layers dimension):
  vllm_cpu   [num_blocks, num_kv_heads, block_size, 2*head_dim]   one opaque run per block
  flash_attn [2, num_blocks, block_size, num_kv_heads, head_dim]  two runs per block: K, then V
  mla        [num_blocks, block_size, latent_dim]                 one run per block
  vllm_hnd   [num_blocks, num_kv_heads, block_size, 2*head_dim]   one run per block (vLLM LBHNC/BLHNC)
  vllm_nhd   [num_blocks, block_size, num_kv_heads, 2*head_dim]   one run per block (vLLM LBNHC/BLNHC)
  state_page [num_blocks, state bytes] (uint8)                     one run per block (a recurrent state)
The vLLM 0.32 layouts of every backend are read by kvconnector.layout_reader.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvprotocol import DEFAULT_CHUNK_SIZE, DTYPES, LayoutDescriptor

if TYPE_CHECKING:
    import numpy as np
    import torch

    # a dtype's name ("bfloat16"), a torch dtype, or a numpy dtype or scalar type
    DType = str | torch.dtype | np.dtype | type[np.generic]


@dataclass(frozen=True, slots=True)
class TagGeometry:
    """How a layout tag's per-layer tensor is indexed."""

    ndim: int  # rank of the per-layer tensor
    block_axis: int  # the axis that indexes blocks
    run_axis: int | None  # the axis separating the runs of one block (K/V), if any
    runs_per_block: int  # contiguous runs one block of one layer is made of
    block_size_axis: int | None  # the axis holding the tokens of a block (None: a state page has none)


TAG_GEOMETRY: dict[str, TagGeometry] = {
    "vllm_cpu": TagGeometry(ndim=4, block_axis=0, run_axis=None, runs_per_block=1, block_size_axis=2),
    "flash_attn": TagGeometry(ndim=5, block_axis=1, run_axis=0, runs_per_block=2, block_size_axis=2),
    "mla": TagGeometry(ndim=3, block_axis=0, run_axis=None, runs_per_block=1, block_size_axis=1),
    # vLLM's [B, H, N, C] views in physical order (kvconnector.layout_reader.ReadLayout.engine_view)
    "vllm_hnd": TagGeometry(ndim=4, block_axis=0, run_axis=None, runs_per_block=1, block_size_axis=2),
    "vllm_nhd": TagGeometry(ndim=4, block_axis=0, run_axis=None, runs_per_block=1, block_size_axis=1),
    # a recurrent-state group (kvconnector.vllm.vllm_layout.state_layout): per layer [num_blocks, bytes]
    "state_page": TagGeometry(ndim=2, block_axis=0, run_axis=None, runs_per_block=1, block_size_axis=None),
}


def dtype_name(dtype: DType) -> str:
    """Canonical dtype string (a key of kvprotocol.DTYPES) for a torch dtype, numpy dtype or name."""
    if isinstance(dtype, str):
        name = dtype
    elif hasattr(dtype, "is_floating_point") or type(dtype).__module__.startswith("torch"):
        name = str(dtype).removeprefix("torch.")
    else:
        import numpy as np

        name = np.dtype(dtype).name
    name = {"half": "float16", "float": "float32", "bfloat": "bfloat16"}.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"unsupported KV dtype {dtype!r}; known: {sorted(DTYPES)}")
    return name


def block_shape_of(tag: str, per_layer_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of one block of one layer (what `block_bytes` covers), from a per-layer shape."""
    geo = tag_geometry(tag)
    if len(per_layer_shape) != geo.ndim:
        raise ValueError(f"{tag} per-layer tensor must have {geo.ndim} dims, got shape {per_layer_shape}")
    shape = list(per_layer_shape)
    del shape[geo.block_axis]  # the run axis (K/V) stays: a block covers both runs
    return tuple(int(d) for d in shape)


def _make(
    tag: str,
    dtype: DType,
    num_layers: int,
    block_size: int,
    block_shape: tuple[int, ...],
    chunk_size: int,
    stacked: bool,
) -> LayoutDescriptor:
    name = dtype_name(dtype)
    block_bytes = math.prod(block_shape) * DTYPES[name]
    return LayoutDescriptor(
        tag=tag,
        dtype=name,
        num_layers=num_layers,
        block_size=block_size,
        block_bytes=block_bytes,
        chunk_size=chunk_size,
        block_shape=block_shape,
        stacked=stacked,
    )


def vllm_cpu_layout(
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: DType,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    stacked: bool = False,
) -> LayoutDescriptor:
    """vLLM CPU backend: per layer [num_blocks, num_kv_heads, block_size, 2*head_dim]; blocks are opaque."""
    shape = (num_kv_heads, block_size, 2 * head_dim)
    return _make("vllm_cpu", dtype, num_layers, block_size, shape, chunk_size, stacked)


def flash_attn_layout(
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: DType,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    stacked: bool = False,
) -> LayoutDescriptor:
    """Flash-attention: per layer [2, num_blocks, block_size, num_kv_heads, head_dim] (K plane, V plane)."""
    shape = (2, block_size, num_kv_heads, head_dim)
    return _make("flash_attn", dtype, num_layers, block_size, shape, chunk_size, stacked)


def mla_layout(
    *,
    num_layers: int,
    latent_dim: int,
    block_size: int,
    dtype: DType,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    stacked: bool = False,
    shared: bool = False,
) -> LayoutDescriptor:
    """MLA latent cache: per layer [num_blocks, block_size, latent_dim].

    `shared=True` when every tensor-parallel rank holds the same latent cache (vLLM's MLA: one KV
    head, replicated): the server then keeps one object per chunk for all ranks (kvprotocol.SHARED_RANK)."""
    layout = _make("mla", dtype, num_layers, block_size, (block_size, latent_dim), chunk_size, stacked)
    return replace(layout, shared=True) if shared else layout


def layout_from_tensor(
    tensor: torch.Tensor | np.ndarray,
    tag: str,
    block_size: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    num_layers: int | None = None,
) -> LayoutDescriptor:
    """Infer the layout from one engine KV tensor (torch or numpy).

    A tensor of the tag's per-layer rank is one layer's cache (`num_layers` is then required); one
    extra leading dimension means a stacked all-layer cache, whose first dimension is num_layers.
    """
    geo = tag_geometry(tag)
    shape = tuple(int(d) for d in tensor.shape)
    stacked = len(shape) == geo.ndim + 1
    if stacked:
        if num_layers is not None and num_layers != shape[0]:
            raise ValueError(f"stacked tensor has {shape[0]} layers, expected {num_layers}")
        num_layers, shape = shape[0], shape[1:]
    elif len(shape) != geo.ndim:
        raise ValueError(f"{tag} tensor must have {geo.ndim} dims (or {geo.ndim + 1} stacked), got {shape}")
    elif num_layers is None:
        raise ValueError("num_layers is required for a per-layer tensor")
    if geo.run_axis is not None and shape[geo.run_axis] != geo.runs_per_block:
        raise ValueError(f"{tag} tensor must have {geo.runs_per_block} at axis {geo.run_axis}, got {shape}")
    if geo.block_size_axis is None:
        raise ValueError(f"a {tag} tensor has no tokens axis: its layout comes from the engine's state spec")
    if shape[geo.block_size_axis] != block_size:
        raise ValueError(f"{tag} tensor holds {shape[geo.block_size_axis]} tokens per block, not {block_size}")
    return _make(tag, tensor.dtype, num_layers, block_size, block_shape_of(tag, shape), chunk_size, stacked)


def tag_geometry(tag: str) -> TagGeometry:
    """The tensor geometry of a supported layout tag (ValueError for others)."""
    try:
        return TAG_GEOMETRY[tag]
    except KeyError:
        raise ValueError(f"unknown layout tag {tag!r}; supported: {sorted(TAG_GEOMETRY)}") from None
