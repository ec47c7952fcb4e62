"""The cache layout of a vLLM engine, computed identically on both sides of the connector.

The scheduler side has no tensors: it derives one layout per KV cache group from vLLM's KVCacheConfig
(the group's attention spec). The worker side derives them from the registered tensors. Both must give
the same LayoutDescriptors (same fingerprints), or lookups and stores would name different objects;
the worker checks this and disables the connector on a mismatch. A single-group engine keeps its
layout (and fingerprint) exactly; vLLM's hybrid manager gives several groups, KV cache group i
being object group i.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard

from kvprotocol import LayoutDescriptor

from ..layout_reader import ReadLayout, UnreadableLayout, read_spec_layout
from ..layouts import layout_from_tensor
from .errors import UnsupportedLayout
from .state_groups import check_state, is_state, state_layout, state_views

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig, KVCacheSpec, SlidingWindowSpec


@dataclass(frozen=True, slots=True)
class KVBackend:
    """Which attention backend writes the engine's blocks (vLLM's name) and what else packs them: the
    CPU attention ISA or CPU MLA backend (the layouts' variant), "" on GPUs, where the KVCacheLayout
    order alone says where every byte is."""

    name: str
    variant: str = ""

    def __str__(self) -> str:
        return f"{self.name}/{self.variant}" if self.variant else self.name


# What vLLM runs on CUDA when the user pins no backend. Only the validity check depends on it: a GPU
# block's bytes are named by the resolved order (layout_reader), whichever backend wrote them.
GPU_DEFAULT_BACKENDS = {"attention": "FLASH_ATTN", "mla": "FLASHMLA"}


def engine_backend(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, device: str | None = None) -> KVBackend:
    """The backend whose blocks the connector reads, on the engine's device ("cpu" or "cuda"; default:
    vLLM's current platform). Another device disables the connector (UnsupportedLayout)."""
    device = device or _device_type()
    spec = _first_attention(kv_cache_config)
    if device == "cpu":
        isa = attention_isa(vllm_config, kv_cache_config)
        if is_mla(spec):
            return KVBackend("AMX_MLA" if isa == "amx_mla" else "CPU_MLA", isa)
        return KVBackend("CPU_ATTN", isa)
    if device == "cuda":
        pinned = _backend_name(vllm_config)
        return KVBackend(pinned or GPU_DEFAULT_BACKENDS["mla" if is_mla(spec) else "attention"])
    raise UnsupportedLayout(f"KV caches on {device} devices are not supported (CPU and CUDA are)")


def _device_type() -> str:
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def attention_group(kv_cache_config: KVCacheConfig) -> tuple[list[str], AttentionSpec]:
    """(layer names, attention spec) of a single-group engine (today's path, unchanged fingerprints)."""
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        raise UnsupportedLayout(f"{len(groups)} KV cache groups where one was expected")
    names, spec = _checked(list(groups[0].layer_names), groups[0].kv_cache_spec, hybrid=False)
    return names, _attention(spec)


def kv_groups(kv_cache_config: KVCacheConfig) -> list[tuple[list[str], KVCacheSpec]]:
    """(layer names, spec) of every KV cache group, in vLLM's group order: object group i is KV cache
    group i. One group is today's path; several come from vLLM's hybrid KV cache manager (the
    connector implements SupportsHMA), each group with its own block table."""
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) == 1:
        return [attention_group(kv_cache_config)]
    try:
        out = [_checked(list(g.layer_names), g.kv_cache_spec, hybrid=True) for g in groups]
        # The CPU attention ISA (the layouts' variant) is read from the first attention group's spec;
        # it depends on the head and block size, so groups that differ in them could be packed
        # otherwise: refused. Every group shares one block size (one block table row per token block).
        attn = [s for _, s in out if _is_attention(s)]
        if not attn:
            raise UnsupportedLayout("no attention group")
        if any((s.head_size, s.block_size) != (attn[0].head_size, attn[0].block_size) for s in attn):
            raise UnsupportedLayout("groups with different head or block sizes are not supported")
        if any(int(s.block_size) != int(attn[0].block_size) for _, s in out):
            raise UnsupportedLayout("state groups with another block size than the attention groups")
        return out
    except UnsupportedLayout as exc:
        raise UnsupportedLayout(f"{len(groups)} KV cache groups (hybrid manager): {exc}") from exc


def _first_attention(kv_cache_config: KVCacheConfig) -> AttentionSpec:
    return next(s for _, s in kv_groups(kv_cache_config) if _is_attention(s))


def _checked(layer_names: list[str], spec: KVCacheSpec, hybrid: bool) -> tuple[list[str], KVCacheSpec]:
    kind = type(spec).__name__
    if hybrid and kind == "MambaSpec":
        check_state(spec)
        return layer_names, spec
    if kind == "MLAAttentionSpec" and not hybrid:
        if getattr(spec, "model_version", None) is not None or getattr(spec, "alignment", None) is not None:
            raise UnsupportedLayout("this MLA cache variant (DeepSeek-V4 style) is not supported")
        return layer_names, _attention(spec)
    if kind == "SlidingWindowSpec":  # vLLM frees blocks out of the window
        if int(getattr(spec, "extra_retained_tokens", 0) or 0):
            raise UnsupportedLayout("sliding windows with extra retained tokens (multi-module MTP) are not supported")
    elif kind != "FullAttentionSpec" or getattr(spec, "attention_chunk_size", None):
        what = "(full attention, one sliding window or MLA)"
        if hybrid:
            what = "in a hybrid model (full attention and sliding windows are)"
        raise UnsupportedLayout(f"KV cache spec {kind} is not supported {what}")
    # A FullAttentionSpec may carry a sliding window: with vLLM's hybrid KV cache manager off, vLLM
    # promotes the windowed layers of a model that mixes them with global ones (Gemma-2/3) to full
    # attention. Their blocks are then never freed, so they are cached as full attention: the KV of a
    # token does not depend on the window, only the attention over it does.
    attn = _attention(spec)
    if getattr(attn, "head_size_v", attn.head_size) != attn.head_size:
        raise UnsupportedLayout("different K and V head sizes are not supported")
    return layer_names, attn


# The kinds _checked lets through, all AttentionSpecs (told by vLLM's class names: vLLM is not
# imported here, so the scheduler side's tests run anywhere).
_ATTENTION_SPECS = ("FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec")


def _is_attention(spec: KVCacheSpec) -> TypeGuard[AttentionSpec]:
    return type(spec).__name__ in _ATTENTION_SPECS


def _is_sliding(spec: KVCacheSpec) -> TypeGuard[SlidingWindowSpec]:
    return type(spec).__name__ == "SlidingWindowSpec"


def _attention(spec: KVCacheSpec) -> AttentionSpec:
    if not _is_attention(spec):  # not reached: _checked refuses every other kind first
        raise UnsupportedLayout(f"KV cache spec {type(spec).__name__} is not an attention spec")
    return spec


def is_mla(spec: KVCacheSpec) -> bool:
    return type(spec).__name__ == "MLAAttentionSpec"


def _kind(layout: LayoutDescriptor, spec: KVCacheSpec) -> LayoutDescriptor:
    """A sliding-window group's objects are window snapshots (kvprotocol._geometry): one per store end."""
    if _is_sliding(spec):
        return dataclasses.replace(layout, kind="sliding", window=int(spec.sliding_window))
    return layout


def attention_isa(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str:
    """The CPU attention ISA that packs each block (vec, vec16, amx, neon, ...), exactly as vLLM picks it.

    The packing inside a block differs per ISA, so it is part of the layout fingerprint: an AMX host
    and an AVX-512 host sharing an L2 tier then miss instead of reading each other's bytes wrongly.
    """
    spec = _first_attention(kv_cache_config)
    if is_mla(spec):
        return _mla_variant(vllm_config)
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError as exc:  # never guess: without the ISA the bytes' meaning is unknown
        raise UnsupportedLayout(f"cannot tell vLLM's CPU attention ISA: {exc}") from exc
    dtype = vllm_config.model_config.dtype
    if isinstance(dtype, str):  # ModelConfig resolves "auto", "half", ... to a torch dtype when built
        raise UnsupportedLayout(f"cannot tell vLLM's CPU attention ISA: model dtype {dtype!r} is unresolved")
    return str(
        _get_attn_isa(
            dtype,
            int(spec.block_size),
            int(spec.head_size),
            vllm_config.cache_config.cache_dtype,
        )
    )


def _mla_variant(vllm_config: VllmConfig) -> str:
    """Which CPU MLA backend writes the latent cache ("cpu_mla", the reference one, or "amx_mla").

    Every tensor-parallel rank of an MLA model holds the same latent cache (one replicated KV head),
    which is why the layout is `shared`; decode context parallelism splits it across ranks instead,
    so it is refused rather than guessed at.
    """
    pc = vllm_config.parallel_config
    if int(getattr(pc, "decode_context_parallel_size", 1) or 1) > 1:
        raise UnsupportedLayout("MLA with decode context parallelism (a sharded latent cache) is not supported")
    import torch

    amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    return "amx_mla" if amx and _backend_name(vllm_config) != "CPU_MLA" else "cpu_mla"


def _backend_name(vllm_config: VllmConfig) -> str:
    """The attention backend the user pinned ("" when none): an AttentionBackendEnum member, whose
    str() is "AttentionBackendEnum.CPU_MLA", or a plain string."""
    backend = getattr(vllm_config.attention_config, "backend", None)
    if backend is None:
        return ""
    return str(getattr(backend, "name", backend)).upper()


def _read(
    kv_cache_config: KVCacheConfig, layer_names: list[str], spec: AttentionSpec, chunk_size: int, backend: KVBackend
) -> ReadLayout:
    """The layout of one group from vLLM's description (spec + resolved KVCacheLayout) and its backend.

    The CPU attention backend only reads LBHNC; an MLA latent cache (one head) has the same bytes in
    every order, so an unresolved layout is read as LBHNC (vLLM's own default order)."""
    if str(spec.dtype).removeprefix("torch.") == "uint8":  # vLLM's fp8 caches
        raise UnsupportedLayout(
            "fp8 KV caches are not supported yet: their per-layer k/v scales belong in the layout "
            "fingerprint and the scheduler cannot see them"
        )
    order = getattr(kv_cache_config, "kv_cache_layout", None) or "LBHNC"
    try:
        return read_spec_layout(
            spec,
            order=order,
            backend=backend.name,
            num_layers=len(layer_names),
            chunk_size=chunk_size,
            variant=backend.variant,
        )
    except UnreadableLayout as exc:
        raise UnsupportedLayout(str(exc)) from exc


def scheduler_layout(kv_cache_config: KVCacheConfig, chunk_size: int, backend: KVBackend) -> LayoutDescriptor:
    """The layout of a single-group engine."""
    layer_names, spec = attention_group(kv_cache_config)
    return _kind(_read(kv_cache_config, layer_names, spec, chunk_size, backend).layout, spec)


def scheduler_layouts(kv_cache_config: KVCacheConfig, chunk_size: int, backend: KVBackend) -> list[LayoutDescriptor]:
    """One layout per KV cache group (the object groups, in vLLM's group order)."""
    return [
        state_layout(spec, len(names), chunk_size)
        if is_state(spec)
        else _kind(_read(kv_cache_config, names, _attention(spec), chunk_size, backend).layout, spec)
        for names, spec in kv_groups(kv_cache_config)
    ]


def worker_layout(
    kv_cache_config: KVCacheConfig, kv_caches: Mapping[str, torch.Tensor], chunk_size: int, backend: KVBackend
) -> tuple[LayoutDescriptor, list[torch.Tensor]]:
    """Layout from the registered tensors of a single-group engine, and its tensors in layer order."""
    layer_names, spec = attention_group(kv_cache_config)
    return _group_views(kv_cache_config, layer_names, spec, kv_caches, chunk_size, backend)


def worker_layouts(
    kv_cache_config: KVCacheConfig, kv_caches: Mapping[str, torch.Tensor], chunk_size: int, backend: KVBackend
) -> tuple[list[LayoutDescriptor], list[list[torch.Tensor]]]:
    """Per KV cache group: its layout from the registered tensors, and its tensors in layer order.
    (With vLLM's hybrid manager, layers of different groups may share memory: block ids of one
    pool keep their blocks apart.)"""
    pairs = [
        state_views(kv_cache_config, names, spec, kv_caches, chunk_size)
        if is_state(spec)
        else _group_views(kv_cache_config, names, _attention(spec), kv_caches, chunk_size, backend)
        for names, spec in kv_groups(kv_cache_config)
    ]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _group_views(
    kv_cache_config: KVCacheConfig,
    layer_names: list[str],
    spec: AttentionSpec,
    kv_caches: Mapping[str, torch.Tensor],
    chunk_size: int,
    backend: KVBackend,
) -> tuple[LayoutDescriptor, list[torch.Tensor]]:
    """The group's tensors in layer order, each viewed in the layout's physical order
    (layout_reader.ReadLayout.engine_view), and the layout they were checked against."""
    missing = [n for n in layer_names if n not in kv_caches]
    if missing:
        raise UnsupportedLayout(f"registered KV caches lack layers {missing[:3]}")
    read = _read(kv_cache_config, layer_names, spec, chunk_size, backend)
    tensors = [kv_caches[n] for n in layer_names]
    first = tensors[0]
    # One device per rank (cuda:<local rank> under tensor parallelism): the copier's streams are its.
    for name, t in zip(layer_names, tensors, strict=True):
        if t.device != first.device:
            raise UnsupportedLayout(f"layer {name} KV is on {t.device}, the first layer's on {first.device}")
        if tuple(t.shape) != tuple(first.shape) or t.stride() != first.stride() or t.dtype != first.dtype:
            raise UnsupportedLayout(f"layer {name} KV is not shaped and strided like the first layer's")
    if is_mla(spec) and first.dim() == 3:  # already [num_blocks, block_size, latent]
        tensors = [t.unsqueeze(1) for t in tensors]
    try:
        views = [read.engine_view(t) for t in tensors]
    except UnreadableLayout as exc:
        raise UnsupportedLayout(str(exc)) from exc
    # the tensors must hold what the spec describes: the layout inferred from them must agree
    seen = layout_from_tensor(views[0], read.layout.tag, int(spec.block_size), chunk_size, len(layer_names))
    if (seen.dtype, seen.block_bytes, seen.block_shape) != (
        read.layout.dtype,
        read.layout.block_bytes,
        read.layout.block_shape,
    ):
        raise UnsupportedLayout(f"KV tensors {tuple(first.shape)} do not match the spec's layout {read.layout}")
    return _kind(read.layout, spec), views
