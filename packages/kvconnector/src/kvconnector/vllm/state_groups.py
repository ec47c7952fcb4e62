"""Recurrent-state groups (Mamba, GDN, short conv: vLLM's MambaSpec) as object groups of kind "state".

vLLM keeps a state per block only in mamba_cache_mode "align" (its mode with prefix caching): block
slot p holds the state after exactly (p + 1) * block_size tokens, and its prefill chunks end on those
boundaries. One object per chunk names that state, so the chunk size must equal vLLM's block size.
vLLM is not imported here (kinds are told by class name), so the scheduler side's tests run anywhere.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, TypeGuard

from kvprotocol import LayoutDescriptor

from .errors import UnsupportedLayout

if TYPE_CHECKING:
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec, MambaSpec


def check_state(spec: KVCacheSpec) -> None:
    """A recurrent-state group (Mamba/GDN/short conv) is cached only as vLLM itself keeps its states:
    in "align" mode block slot p holds the state after exactly (p + 1) * block_size tokens (vLLM's
    prefill chunks end on those boundaries), which is what one state object per chunk names."""
    mamba = getattr(getattr(spec, "mamba_type", None), "name", "MambaSpec")
    mode = getattr(spec, "mamba_cache_mode", "?")
    if mode != "align":
        raise UnsupportedLayout(
            f"hybrid model with recurrent-state layers ({mamba}, mamba_cache_mode {mode!r}): states are "
            "cached only in mamba_cache_mode 'align' (vLLM's choice with prefix caching on)"
        )
    if int(getattr(spec, "num_speculative_blocks", 0) or 0):
        raise UnsupportedLayout(f"recurrent-state layers ({mamba}) with speculative blocks are not supported")


def is_state(spec: KVCacheSpec) -> TypeGuard[MambaSpec]:
    return type(spec).__name__ == "MambaSpec"


def state_layout(spec: MambaSpec, num_layers: int, chunk_size: int) -> LayoutDescriptor:
    """One object per chunk: every layer's state page (its content, not vLLM's padding) after the
    chunk's last token. The variant names the state's kind, shapes and dtypes (what the bytes mean)."""
    if chunk_size != int(spec.block_size):  # a wrong setting, not a model we leave alone: refuse to start
        raise ValueError(
            f"chunk_size {chunk_size} must equal vLLM's block size {spec.block_size} for a model with "
            "recurrent-state layers (one state per chunk, where vLLM keeps them): set chunk_size to it"
        )
    mamba = str(getattr(getattr(spec, "mamba_type", None), "name", "mamba")).lower()
    what = repr((mamba, [list(x) for x in spec.shapes], [str(d) for d in spec.dtypes])).encode()
    content = int(spec.state_content_size_bytes)
    return LayoutDescriptor(
        tag="state_page",
        dtype="uint8",
        num_layers=num_layers,
        block_size=int(spec.block_size),
        block_bytes=content,
        chunk_size=chunk_size,
        block_shape=(content,),
        variant=f"{mamba[:14]}_{hashlib.sha256(what).hexdigest()[:16]}",
        kind="state",
    )


def state_views(
    kv_cache_config: KVCacheConfig,
    layer_names: list[str],
    spec: MambaSpec,
    kv_caches: Mapping[str, torch.Tensor],
    chunk_size: int,
) -> tuple[LayoutDescriptor, list[torch.Tensor]]:
    """Per layer a byte view [num_blocks, state content] of its state pages. vLLM registers a state
    layer as an int8 page view [num_blocks, 1, 1, page] (what MambaBase.bind_kv_cache unpacks: the
    layer's states, conv then ssm, packed from the page's first byte) or as the whole backing
    allocation, where its KVCacheTensor places layer l's page of block b at offset + l *
    layer_stride + b * block_stride."""
    import torch

    layout = state_layout(spec, len(layer_names), chunk_size)
    content = int(spec.state_content_size_bytes)
    placement = {name: (t, i) for t in kv_cache_config.kv_cache_tensors for i, name in enumerate(t.layers)}
    views: list[torch.Tensor] = []
    for name in layer_names:
        buf = kv_caches.get(name)
        if not isinstance(buf, torch.Tensor) or buf.element_size() != 1:
            raise UnsupportedLayout(f"layer {name}: expected vLLM's int8 state pages, got {type(buf).__name__}")
        if buf.dim() == 4 and tuple(buf.shape[1:3]) == (1, 1) and buf.stride(-1) == 1:
            num_blocks, start, stride, end = int(buf.shape[0]), 0, int(buf.stride(0)), int(buf.shape[3])
        elif buf.dim() == 1 and name in placement:
            tensor, index = placement[name]
            num_blocks = int(kv_cache_config.num_blocks_of(tensor))
            start = int(tensor.offset) + index * int(tensor.layer_stride)
            stride = int(tensor.block_stride)
            end = buf.numel() - start - (num_blocks - 1) * stride
        else:
            raise UnsupportedLayout(f"layer {name}: state pages shaped {tuple(buf.shape)} are not vLLM's")
        if stride < content or end < content:
            raise UnsupportedLayout(f"layer {name}: its state pages hold less than the spec's {content} bytes")
        views.append(
            torch.tensor([], dtype=torch.uint8, device=buf.device).set_(
                buf.untyped_storage(), buf.storage_offset() + start, (num_blocks, content), (stride, 1)
            )
        )
    return layout, views
