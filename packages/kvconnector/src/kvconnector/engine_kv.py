"""EngineKV: where one rank's paged KV lives in host memory; which blocks move (Moves); the one
builder of copy rows (`block_rows`); and the Copier interface with its host-memory implementation.

Why vectorised: every store and retrieve turns (objects x layers x blocks x runs) into (src, dst, len)
rows; for a long prompt that is tens of thousands of rows, and a Python loop would cost more than the
copy. `block_rows` is the only place rows are built (production, tests and bench alike): rows come out
in object order (object, layer, block-in-object, run), so one pass (`merge_segments`) joins neighbours
that are contiguous on both sides (consecutive block ids, adjacent objects) into one memcpy.

Both sides of a row are absolute addresses, so the kernels run with base 0:
  gather  (engine -> object): rows (engine_addr, object_addr, len)
  scatter (object -> engine): rows (object_addr, engine_addr, len)
Objects are given by absolute host addresses (arena base + offset in shm mode, a received frame or
send buffer in tcp mode), so one kernel call serves every layer. An object holds
[layer][block-in-chunk][block_bytes] (kvprotocol.LayoutDescriptor); inside a block the runs (K and V
for flash_attn) follow each other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from kvprotocol import DTYPES, GroupGeometry, LayoutDescriptor

from . import copy as kvcopy
from .layouts import TAG_GEOMETRY, block_shape_of, dtype_name, tag_geometry

if TYPE_CHECKING:
    import torch

    KVTensor = torch.Tensor | np.ndarray  # host memory (torch on the CPU, or numpy)
    LayerTensors = Sequence[KVTensor] | KVTensor  # per-layer tensors, or one stacked [layers, ...]


@dataclass(frozen=True)
class Moves:
    """Block moves of one object group: object index, slot inside the object, engine block id."""

    obj: np.ndarray
    slot: np.ndarray
    block: np.ndarray

    def __len__(self) -> int:
        return int(self.block.shape[0])


def load_moves(
    block_table: np.ndarray, blocks_per_chunk: int, start_chunk: int, first_block: int, end_block: int
) -> Moves:
    """Moves that write request blocks [first_block, end_block) from objects of chunks start_chunk.."""
    j = np.arange(first_block, end_block, dtype=np.int64)
    if end_block > block_table.shape[0]:
        raise ValueError(f"block_ids has {block_table.shape[0]} entries, the load needs {end_block}")
    return Moves(j // blocks_per_chunk - start_chunk, j % blocks_per_chunk, block_table[j])


def window_moves(block_table: np.ndarray, base: int, lo: int, hi: int) -> Moves:
    """Moves between request blocks [lo, hi) and slots of ONE object whose slot 0 is request block
    `base` (a sliding-window snapshot or a recurrent state: the blocks ending at its boundary)."""
    if hi > block_table.shape[0]:
        raise ValueError(f"block_ids has {block_table.shape[0]} entries, the transfer needs {hi}")
    j = np.arange(max(lo, 0), hi, dtype=np.int64)
    return Moves(np.zeros_like(j), j - base, block_table[j])


def save_moves(
    block_table: np.ndarray, blocks_per_chunk: int, chunks: Sequence[int], last_blocks: int | None = None
) -> Moves:
    """Moves that fill whole objects, object i being chunk chunks[i] of the request; with
    `last_blocks`, only that many leading slots of the last object (a tail: a partial last chunk)."""
    c = np.asarray(chunks, dtype=np.int64)
    slot = np.tile(np.arange(blocks_per_chunk, dtype=np.int64), c.shape[0])
    obj = np.repeat(np.arange(c.shape[0], dtype=np.int64), blocks_per_chunk)
    if last_blocks is not None and c.shape[0]:
        keep = (obj < c.shape[0] - 1) | (slot < last_blocks)
        slot, obj = slot[keep], obj[keep]
    j = c[obj] * blocks_per_chunk + slot
    if j.size and int(j.max()) >= block_table.shape[0]:
        raise ValueError("block_ids do not cover the chunks to save")
    return Moves(obj, slot, block_table[j])


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def token_blocks(skip: int, num: int, block_size: int) -> tuple[int, int]:
    """Request blocks [lo, hi) holding tokens [skip, num): the block holding `skip` only when skip
    starts it (a partial block before skip is the engine's), the partial block at `num` included."""
    return ceil_div(skip, block_size), ceil_div(num, block_size)


def block_range(geo: GroupGeometry, lay: LayoutDescriptor, skip: int, num: int, unit: int) -> tuple[int, int]:
    """Request blocks [lo, hi) of one group that a load of tokens [skip, num) writes (see
    kvprotocol._geometry): of a sliding group only the window the first computed token attends to
    (tokens [num - W + 1, num)), of a state group only the blocks of the object holding the state at num.
    The one place this is computed: the copy plan and the blocks a failed load reports both use it."""
    bs = lay.block_size
    if geo.kind == "state":
        top = num // bs
        return top - lay.blocks_per_chunk, top
    if geo.kind == "sliding":
        top = ceil_div(num, unit) * unit // bs
        return max(top - lay.blocks_per_chunk, max(skip, num - geo.window + 1, 0) // bs, 0), ceil_div(num, bs)
    return token_blocks(skip, num, bs)


def load_block_ids(
    geoms: Sequence[GroupGeometry],
    layouts: Sequence[LayoutDescriptor],
    tables: Sequence[np.ndarray],
    skip: int,
    num: int,
    unit: int,
) -> list[int]:
    """Every engine block, over all groups, that a load of tokens [skip, num) writes (block_range of
    each group, clipped to its table): what a load that failed while copying reports."""
    out: set[int] = set()
    for geo, lay, table in zip(geoms, layouts, tables, strict=False):
        lo, hi = block_range(geo, lay, skip, num, unit)
        out.update(int(b) for b in table[max(0, lo) : min(table.shape[0], hi)])
    return sorted(out)


def promised_block_ids(table: Sequence[int], block_size: int, skip: int, num: int) -> list[int]:
    """Blocks of one group's `table` holding tokens [skip, num) (token_blocks): what a vLLM worker
    reports failed when a load fails before the copy could name its blocks. The whole promised range,
    not block_range's window: vLLM recomputes from the first failed block of that one table."""
    lo, hi = token_blocks(skip, num, block_size)
    return list(table[lo:hi])


def window_base(lay: LayoutDescriptor, end_unit: int, unit: int) -> int:
    """The request block in slot 0 of an exact-kind object ending at unit end_unit (< 0: before token 0)."""
    return (end_unit + 1) * unit // lay.block_size - lay.blocks_per_chunk


def check_blocks(moves: Moves, num_blocks: int, *, distinct: bool) -> None:
    """Engine block ids must exist, and a scatter must not write one block twice."""
    b = moves.block
    if b.size and (int(b.min()) < 0 or int(b.max()) >= num_blocks):
        raise ValueError(f"block id out of range [0, {num_blocks})")
    if distinct and np.unique(b).size != b.size:
        raise ValueError("a block id appears twice in the load range")


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
    def from_stacked(
        cls,
        layout: LayoutDescriptor,
        base: int,
        layer_stride: int,
        num_blocks: int,
        block_stride: int | None = None,
        run_stride: int | None = None,
    ) -> EngineKV:
        """One all-layer allocation: layer l starts at base + l * layer_stride (contiguous defaults)."""
        return cls.from_layer_bases(
            layout, [base + i * layer_stride for i in range(layout.num_layers)], num_blocks, block_stride, run_stride
        )

    @classmethod
    def from_layer_bases(
        cls,
        layout: LayoutDescriptor,
        layer_bases: Sequence[int] | np.ndarray,
        num_blocks: int,
        block_stride: int | None = None,
        run_stride: int | None = None,
    ) -> EngineKV:
        """Per-layer base addresses of contiguous per-layer tensors (strides default to contiguous)."""
        runs = _runs_per_block(layout.tag)
        bstride = layout.block_bytes // runs if block_stride is None else block_stride
        rstride = (num_blocks * bstride if runs > 1 else 0) if run_stride is None else run_stride
        return cls(layout, np.asarray(layer_bases, dtype=np.int64), num_blocks, bstride, rstride)

    @classmethod
    def from_tensors(cls, layout: LayoutDescriptor, tensors: LayerTensors) -> EngineKV:
        """From the engine's KV tensors (torch CPU or numpy): a list of per-layer tensors, or one
        stacked tensor with a leading layer dimension. Strides are read from the tensors, so padded
        block strides work; each run (one block's K or V) must itself be contiguous."""
        if isinstance(tensors, Sequence):
            per_layer = list(tensors)
        else:
            per_layer = [tensors[i] for i in range(tensors.shape[0])]
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
        run_dims = shape[max(geo.block_axis, geo.run_axis if geo.run_axis is not None else -1) + 1 :]
        run_strides = strides[len(shape) - len(run_dims) :]
        if not _is_contiguous(run_dims, run_strides, item):
            raise ValueError("each block run must be contiguous in memory")
        if math.prod(run_dims) * item * geo.runs_per_block != layout.block_bytes:
            raise ValueError("tensor block size does not match layout block_bytes")
        for t in per_layer[1:]:
            if tuple(int(d) for d in t.shape) != shape or _byte_strides(t) != strides:
                raise ValueError("all layer tensors must share one shape and stride")
        bases = [kvcopy.address_of(t) for t in per_layer]
        run_stride = strides[geo.run_axis] if geo.run_axis is not None else 0
        return cls(
            layout, np.asarray(bases, dtype=np.int64), shape[geo.block_axis], strides[geo.block_axis], run_stride
        )


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


def block_rows(kv: EngineKV, obj_addrs: np.ndarray, moves: Moves, gather: bool) -> np.ndarray:
    """(src, dst, len) rows that move `moves` between the engine and the objects at absolute addresses
    `obj_addrs` (gather: engine -> objects), in object order, merged."""
    lay = kv.layout
    runs, run_bytes = kv.runs_per_block, kv.run_bytes
    layers = np.arange(lay.num_layers, dtype=np.int64)
    r = np.arange(runs, dtype=np.int64)
    # (move, layer, run)
    engine = (
        kv.layer_bases[None, :, None] + moves.block[:, None, None] * kv.block_stride + r[None, None, :] * kv.run_stride
    )
    obj = (
        obj_addrs[moves.obj][:, None, None]
        + (layers[None, :, None] * lay.blocks_per_chunk + moves.slot[:, None, None]) * lay.block_bytes
        + r[None, None, :] * run_bytes
    )
    # object order (object, layer, slot, run) lets neighbours on both sides merge into one memcpy
    order = np.lexsort(
        (
            np.broadcast_to(moves.slot[:, None, None], obj.shape).reshape(-1),
            np.broadcast_to(layers[None, :, None], obj.shape).reshape(-1),
            np.broadcast_to(moves.obj[:, None, None], obj.shape).reshape(-1),
        ),
        axis=0,
    )
    rows = np.empty((obj.size, 3), dtype=np.int64)
    src, dst = (engine, obj) if gather else (obj, engine)
    rows[:, 0] = src.reshape(-1)[order]
    rows[:, 1] = dst.reshape(-1)[order]
    rows[:, 2] = run_bytes
    return merge_segments(rows)


def object_table(obj_addrs: np.ndarray, size: int) -> np.ndarray:
    """(addr, size) rows, one per object, for `copy_checksum` with base 0."""
    table = np.empty((obj_addrs.shape[0], 2), dtype=np.int64)
    table[:, 0] = obj_addrs
    table[:, 1] = size
    return table


class Copier(Protocol):
    """Moves blocks between one rank's KV (all groups) and objects in host memory, and checksums the
    objects (kvsum64, docs/engine.md "Verified reads")."""

    def num_blocks(self, group: int) -> int: ...

    def scatter(self, group: int, obj_addrs: np.ndarray, moves: Moves, expected: Sequence[int]) -> list[int]:
        """Copy, and return the indices of objects whose bytes do not have the `expected` checksum
        (their blocks may have been written: the caller fails the whole load)."""
        ...

    def gather(self, group: int, obj_addrs: np.ndarray, moves: Moves) -> list[int] | None:
        """Copy; return each object's kvsum64 as written, or None when the checksums can only be
        taken from the objects after `finish` (the caller does that)."""
        ...

    def finish(self) -> None:
        """Wait until every copy issued so far is complete (a no-op for synchronous copiers)."""

    def attach_arena(self, addr: int, size: int) -> None:
        """A (new) arena mapping is in use: e.g. pin it for DMA."""

    def detach_arena(self) -> None:
        """The arena mapping is about to go away."""


class HostCopier:
    """The CPU copier: KV in host memory, moved by the csrc `copy_checksum` kernel (copy and checksum
    fused), one call per group and direction."""

    def __init__(self, groups: Sequence[EngineKV], keepalive: object = None, num_threads: int = 0) -> None:
        self.groups = list(groups)
        self._keepalive = keepalive  # the engine's tensors: their addresses are in `groups`
        self.num_threads = num_threads

    def num_blocks(self, group: int) -> int:
        return self.groups[group].num_blocks

    def scatter(self, group: int, obj_addrs: np.ndarray, moves: Moves, expected: Sequence[int]) -> list[int]:
        kv = self.groups[group]
        got = kvcopy.copy_checksum(
            0,
            0,
            block_rows(kv, obj_addrs, moves, False),
            object_table(obj_addrs, kv.layout.object_bytes),
            "src",
            self.num_threads,
        )
        return [i for i, (g, e) in enumerate(zip(got, expected, strict=True)) if g != e]

    def gather(self, group: int, obj_addrs: np.ndarray, moves: Moves) -> list[int] | None:
        kv = self.groups[group]
        return kvcopy.copy_checksum(
            0,
            0,
            block_rows(kv, obj_addrs, moves, True),
            object_table(obj_addrs, kv.layout.object_bytes),
            "dst",
            self.num_threads,
        )

    def finish(self) -> None:
        return None

    def attach_arena(self, addr: int, size: int) -> None:
        return None

    def detach_arena(self) -> None:
        return None
