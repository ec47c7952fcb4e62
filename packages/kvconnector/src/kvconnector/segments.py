"""Copy segments between an engine's paged KV and chunk objects, computed with numpy.

Why vectorised: every store and retrieve turns (chunks x layers x blocks x runs) into (src, dst, len)
rows; for a long prompt that is tens of thousands of rows, and a Python loop would cost more than the
copy. Rows come out in object order (chunk, layer, block-in-chunk, run), so one pass can merge
neighbours that are contiguous on both sides (consecutive block ids, adjacent objects) into one memcpy.

Conventions: engine addresses are absolute; object positions are offsets from an object-side base
(the shm arena base, or a buffer's address) that is passed to `batch_copy`:
  gather  (engine -> object): rows (engine_addr, object_off, len), copy with batch_copy(0, object_base, rows)
  scatter (object -> engine): rows (object_off, engine_addr, len), copy with batch_copy(object_base, 0, rows)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from kvprotocol import DTYPES, LayoutDescriptor

from . import copy as kvcopy
from .layouts import TAG_GEOMETRY, block_shape_of, dtype_name, tag_geometry

Direction = Literal["gather", "scatter"]


@dataclass(frozen=True)
class EngineKV:
    """Where one rank's paged KV lives: per-layer base addresses and the strides inside a layer.

    Run r (0 = K, 1 = V for flash_attn) of block b of layer l starts at
    `layer_bases[l] + b * block_stride + r * run_stride` and is `run_bytes` long.
    """

    layout: LayoutDescriptor
    layer_bases: np.ndarray = field(repr=False)  # int64 [num_layers]
    num_blocks: int
    block_stride: int
    run_stride: int = 0

    def __post_init__(self) -> None:
        bases = np.ascontiguousarray(self.layer_bases, dtype=np.int64).reshape(-1)
        object.__setattr__(self, "layer_bases", bases)
        if bases.shape[0] != self.layout.num_layers:
            raise ValueError(f"{bases.shape[0]} layer bases for a {self.layout.num_layers}-layer layout")
        if (bases <= 0).any():
            raise ValueError("layer base addresses must be positive")
        if self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if self.block_stride < self.run_bytes:
            raise ValueError(f"block_stride {self.block_stride} is smaller than a run ({self.run_bytes} bytes)")
        if self.runs_per_block > 1:
            planes = self.run_stride >= self.num_blocks * self.block_stride  # [2, num_blocks, ...]
            # [num_blocks, 2, ...]
            interleaved = self.run_bytes <= self.run_stride <= self.block_stride - self.run_bytes
            if not (planes or interleaved):
                raise ValueError("run_stride makes the K and V runs of different blocks overlap")

    @property
    def runs_per_block(self) -> int:
        return _runs_per_block(self.layout.tag)

    @property
    def run_bytes(self) -> int:
        return self.layout.block_bytes // self.runs_per_block

    @classmethod
    def from_stacked(cls, layout: LayoutDescriptor, base: int, layer_stride: int, num_blocks: int,
                     block_stride: int | None = None, run_stride: int | None = None) -> EngineKV:
        """One all-layer allocation: layer l starts at base + l * layer_stride (contiguous defaults)."""
        return cls.from_layer_bases(layout, [base + i * layer_stride for i in range(layout.num_layers)],
                                    num_blocks, block_stride, run_stride)

    @classmethod
    def from_layer_bases(cls, layout: LayoutDescriptor, layer_bases: Sequence[int] | np.ndarray,
                         num_blocks: int, block_stride: int | None = None,
                         run_stride: int | None = None) -> EngineKV:
        """Per-layer base addresses of contiguous per-layer tensors (strides default to contiguous)."""
        runs = _runs_per_block(layout.tag)
        bstride = layout.block_bytes // runs if block_stride is None else block_stride
        rstride = (num_blocks * bstride if runs > 1 else 0) if run_stride is None else run_stride
        return cls(layout, np.asarray(layer_bases, dtype=np.int64), num_blocks, bstride, rstride)

    @classmethod
    def from_tensors(cls, layout: LayoutDescriptor, tensors: Any) -> EngineKV:
        """From the engine's KV tensors (torch CPU or numpy): a list of per-layer tensors, or one
        stacked tensor with a leading layer dimension. Strides are read from the tensors, so padded
        block strides work; each run (one block's K or V) must itself be contiguous."""
        stacked = not isinstance(tensors, (list, tuple))
        per_layer = [tensors[i] for i in range(tensors.shape[0])] if stacked else list(tensors)
        if len(per_layer) != layout.num_layers:
            raise ValueError(f"{len(per_layer)} layer tensors for a {layout.num_layers}-layer layout")
        geo = tag_geometry(layout.tag)
        first = per_layer[0]
        shape = tuple(int(d) for d in first.shape)
        strides = _byte_strides(first)
        if dtype_name(first.dtype) != layout.dtype:
            raise ValueError(f"tensor dtype {first.dtype} does not match layout dtype {layout.dtype}")
        if layout.block_shape and block_shape_of(layout.tag, shape) != tuple(layout.block_shape):
            raise ValueError(f"tensor shape {shape} does not match layout block_shape {layout.block_shape}")
        item = DTYPES[layout.dtype]
        run_dims = shape[max(geo.block_axis, geo.run_axis if geo.run_axis is not None else -1) + 1:]
        run_strides = strides[len(shape) - len(run_dims):]
        if not _is_contiguous(run_dims, run_strides, item):
            raise ValueError("each block run must be contiguous in memory")
        if math.prod(run_dims) * item * geo.runs_per_block != layout.block_bytes:
            raise ValueError("tensor block size does not match layout block_bytes")
        for t in per_layer[1:]:
            if tuple(int(d) for d in t.shape) != shape or _byte_strides(t) != strides:
                raise ValueError("all layer tensors must share one shape and stride")
        bases = [kvcopy.address_of(t) for t in per_layer]
        run_stride = strides[geo.run_axis] if geo.run_axis is not None else 0
        return cls(layout, np.asarray(bases, dtype=np.int64), shape[geo.block_axis],
                   strides[geo.block_axis], run_stride)


def _byte_strides(t: Any) -> tuple[int, ...]:
    if isinstance(t, np.ndarray):
        return tuple(int(s) for s in t.strides)
    return tuple(int(s) * int(t.element_size()) for s in t.stride())  # torch: strides in elements


def _is_contiguous(dims: tuple[int, ...], strides: tuple[int, ...], item: int) -> bool:
    """C-contiguous, ignoring the strides of size-1 dimensions (they never move)."""
    expected = item
    for d, s in zip(reversed(dims), reversed(strides)):
        if d != 1 and s != expected:
            return False
        expected *= d
    return True


def _runs_per_block(tag: str) -> int:
    """Runs per block of one layer; tags we have no geometry for are one opaque run."""
    return TAG_GEOMETRY[tag].runs_per_block if tag in TAG_GEOMETRY else 1


def merge_segments(segments: np.ndarray) -> np.ndarray:
    """Merge neighbouring rows that continue each other on both sides into one row (vectorised)."""
    seg = np.asarray(segments, dtype=np.int64).reshape(-1, 3)
    if seg.shape[0] < 2:
        return seg
    src, dst, ln = seg[:, 0], seg[:, 1], seg[:, 2]
    joins = (src[1:] == src[:-1] + ln[:-1]) & (dst[1:] == dst[:-1] + ln[:-1])
    if not joins.any():
        return seg
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    out = seg[starts].copy()
    out[:, 2] = np.add.reduceat(ln, starts)
    return out


def _as_block_table(block_ids: Any, object_offsets: Any, bpc: int) -> tuple[np.ndarray, np.ndarray]:
    blocks = np.asarray(block_ids, dtype=np.int64)
    offs = np.asarray(object_offsets, dtype=np.int64)
    if blocks.ndim == 1 and offs.ndim == 0:  # one chunk
        blocks, offs = blocks[None, :], offs[None]
    if blocks.ndim != 2 or blocks.shape[1] != bpc:
        raise ValueError(f"block_ids must have shape (chunks, {bpc}), got {blocks.shape}")
    if offs.shape != (blocks.shape[0],):
        raise ValueError(f"need one object offset per chunk: {offs.shape} for {blocks.shape[0]} chunks")
    return blocks, offs


def _as_layers(layers: Any, num_layers: int) -> np.ndarray:
    if layers is None:
        return np.arange(num_layers, dtype=np.int64)
    if isinstance(layers, slice):
        return np.arange(num_layers, dtype=np.int64)[layers]
    arr = np.asarray(layers, dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= num_layers):
        raise ValueError(f"layer index out of range [0, {num_layers})")
    return arr


def chunk_segments(kv: EngineKV, block_ids: Any, object_offsets: Any, direction: Direction, *,
                   layers: Any = None, merge: bool = True, object_limit: int | None = None) -> np.ndarray:
    """(src, dst, len) rows moving whole chunks between the engine and their objects.

    `block_ids`: (chunks, blocks_per_chunk) engine block ids, or one chunk's 1-D list with a scalar
    `object_offsets`. `object_offsets`: per chunk, the object's offset from the object-side base.
    `layers`: optional subset (indices or slice) for layer-wise transfers; each layer still lands at
    its own place in the object. `object_limit`: if given, every object must end at or before it.
    Validation (ValueError): block ids in [0, num_blocks); objects non-negative, within the limit and
    non-overlapping for gather; no block id twice for scatter (destinations must be disjoint).
    """
    lay = kv.layout
    bpc, runs, run_bytes = lay.blocks_per_chunk, kv.runs_per_block, kv.run_bytes
    blocks, offs = _as_block_table(block_ids, object_offsets, bpc)
    lidx = _as_layers(layers, lay.num_layers)
    if blocks.size and (blocks.min() < 0 or blocks.max() >= kv.num_blocks):
        raise ValueError(f"block id out of range [0, {kv.num_blocks})")
    if offs.size and offs.min() < 0:
        raise ValueError("object offsets must be >= 0")
    if object_limit is not None and offs.size and int(offs.max()) + lay.object_bytes > object_limit:
        raise ValueError("an object extends past object_limit")
    if direction == "gather":
        ordered = np.sort(offs)
        if ordered.size > 1 and (np.diff(ordered) < lay.object_bytes).any():
            raise ValueError("chunk objects overlap (gather destinations must be disjoint)")
    elif direction == "scatter":
        if np.unique(blocks).size != blocks.size:
            raise ValueError("a block id appears twice (scatter destinations must be disjoint)")
    else:
        raise ValueError(f"direction must be 'gather' or 'scatter', got {direction!r}")

    r = np.arange(runs, dtype=np.int64)
    # Broadcast to (chunk, layer, block-in-chunk, run): object order.
    engine = (kv.layer_bases[lidx][None, :, None, None]
              + blocks[:, None, :, None] * kv.block_stride
              + r[None, None, None, :] * kv.run_stride)
    slot = lidx[:, None] * bpc + np.arange(bpc, dtype=np.int64)[None, :]  # block slot in the object
    obj = (offs[:, None, None, None]
           + slot[None, :, :, None] * lay.block_bytes
           + r[None, None, None, :] * run_bytes)
    engine, obj = np.broadcast_arrays(engine, obj)
    out = np.empty((engine.size, 3), dtype=np.int64)
    src_col, dst_col = (0, 1) if direction == "gather" else (1, 0)
    out[:, src_col] = engine.reshape(-1)
    out[:, dst_col] = obj.reshape(-1)
    out[:, 2] = run_bytes
    return merge_segments(out) if merge else out


def gather(kv: EngineKV, block_ids: Any, object_base: int, object_offsets: Any, *, layers: Any = None,
           num_threads: int = 0, object_limit: int | None = None) -> int:
    """Copy engine blocks into chunk objects at object_base + object_offsets[c]. Returns bytes copied."""
    rows = chunk_segments(kv, block_ids, object_offsets, "gather", layers=layers, object_limit=object_limit)
    return kvcopy.batch_copy(0, object_base, rows, num_threads)


def scatter(kv: EngineKV, block_ids: Any, object_base: int, object_offsets: Any, *, layers: Any = None,
            num_threads: int = 0, object_limit: int | None = None) -> int:
    """Copy chunk objects at object_base + object_offsets[c] into engine blocks. Returns bytes copied."""
    rows = chunk_segments(kv, block_ids, object_offsets, "scatter", layers=layers, object_limit=object_limit)
    return kvcopy.batch_copy(object_base, 0, rows, num_threads)
