"""The CUDA copier: block moves as torch index operations, for KV that lives on a GPU.

Why torch ops and not the csrc kernel: a GPU's KV cannot be reached with memcpy from the host. Each
transfer stages whole objects on the KV's device (one host<->device copy per object, asynchronous
when the host side is pinned, e.g. the cudaHostRegister'ed arena), then moves blocks with one
`index_put_` per layer, all on the engine's current stream. The indexing is device-agnostic, so it
is tested on CPU tensors (`copy_backend="torch"`); only the three CUDA calls at the top (pin, unpin,
synchronise) are GPU-specific, kept to a few lines that docs/engine.md lists as untested until run
on a GPU. They degrade instead of raising: an unpinned arena still copies correctly, just
synchronously.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from kvprotocol import LayoutDescriptor

from . import copy as kvcopy
from .engine_kv import Moves
from .layouts import tag_geometry

DEFAULT_STAGE_BYTES = 256 << 20  # device staging per step; bounds the transient device memory

_log = logging.getLogger("kvconnector.cuda")


def pin_host(addr: int, size: int) -> bool:
    """cudaHostRegister the range (the shm arena) so host<->device copies are asynchronous DMA.

    Registering page-locks, and therefore commits, the whole range: size the arena for that.
    """
    try:
        cudart = torch.cuda.cudart()
        torch.cuda.check_error(cudart.cudaHostRegister(addr, size, 0))
        return True
    except Exception as exc:  # not fatal: copies fall back to pageable (synchronous) transfers
        _log.warning("could not pin the shm arena for DMA (%s); copies will be synchronous", exc)
        return False


def unpin_host(addr: int) -> None:
    try:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(addr))
    except Exception as exc:
        _log.warning("cudaHostUnregister failed: %s", exc)


def synchronize(device: torch.device) -> None:
    """Wait for the engine's current stream: the copies were issued on it, in order."""
    torch.cuda.current_stream(device).synchronize()


def host_bytes(addr: int, size: int) -> torch.Tensor:
    """A uint8 CPU tensor over `size` bytes at `addr` (no copy; the caller keeps the memory alive)."""
    return torch.frombuffer((ctypes.c_uint8 * size).from_address(addr), dtype=torch.uint8)


def block_views(layout: LayoutDescriptor, tensors: Any) -> list[torch.Tensor]:
    """Per layer, a uint8 view [num_blocks, runs, run_bytes] that aliases the engine's tensor."""
    layers = [tensors[i] for i in range(tensors.shape[0])] if isinstance(tensors, torch.Tensor) else list(tensors)
    if len(layers) != layout.num_layers:
        raise ValueError(f"{len(layers)} layer tensors for a {layout.num_layers}-layer layout")
    geo = tag_geometry(layout.tag)
    lead = max(geo.block_axis, geo.run_axis if geo.run_axis is not None else -1) + 1
    views = []
    for t in layers:
        v = t.view(*t.shape[:lead], -1).view(torch.uint8)  # raises if a run is not contiguous
        if geo.run_axis is None:
            v = v.unsqueeze(1)
        else:
            v = v.permute(geo.block_axis, geo.run_axis, 2)
        if v.shape[1] * v.shape[2] != layout.block_bytes:
            raise ValueError(f"tensor blocks hold {v.shape[1] * v.shape[2]} bytes, layout says {layout.block_bytes}")
        views.append(v)
    return views


class TorchCopier:
    """The CUDA Copier (see `engine_kv.Copier`): torch tensors on any device."""

    def __init__(
        self, layouts: Sequence[LayoutDescriptor], groups: Sequence[Any], stage_bytes: int = DEFAULT_STAGE_BYTES
    ) -> None:
        self.layouts = list(layouts)
        self.views = [block_views(lay, g) for lay, g in zip(self.layouts, groups, strict=True)]
        self.device = self.views[0][0].device
        self.stage_bytes = stage_bytes
        self._pinned: int | None = None

    def num_blocks(self, group: int) -> int:
        return int(self.views[group][0].shape[0])

    def attach_arena(self, addr: int, size: int) -> None:
        """Pin the arena for asynchronous DMA when the KV is on a GPU."""
        if self.device.type == "cuda" and self._pinned is None and pin_host(addr, size):
            self._pinned = addr

    def detach_arena(self) -> None:
        if self._pinned is not None:
            unpin_host(self._pinned)
            self._pinned = None

    def _batches(self, group: int, n_obj: int) -> list[tuple[int, int]]:
        per = max(1, self.stage_bytes // self.layouts[group].object_bytes)
        return [(lo, min(n_obj, lo + per)) for lo in range(0, n_obj, per)]

    def _staged(self, group: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        lay = self.layouts[group]
        stage = torch.empty((n, lay.object_bytes), dtype=torch.uint8, device=self.device)
        runs = self.views[group][0].shape[1]
        shaped = stage.view(n, lay.num_layers, lay.blocks_per_chunk, runs, lay.block_bytes // runs)
        return stage, shaped

    def _index(self, moves: Moves, lo: int, hi: int) -> tuple[torch.Tensor, ...]:
        sel = (moves.obj >= lo) & (moves.obj < hi)
        return tuple(
            torch.from_numpy(np.ascontiguousarray(a[sel])).to(self.device)
            for a in (moves.obj - lo, moves.slot, moves.block)
        )

    def scatter(self, group: int, obj_addrs: np.ndarray, moves: Moves, expected: Sequence[int]) -> list[int]:
        """Verifies each object in host memory first (a separate pass: the device copy cannot sum), then
        copies only when every object matched."""
        size = self.layouts[group].object_bytes
        bad = [i for i, e in enumerate(expected) if kvcopy.checksum(int(obj_addrs[i]), size) != e]
        if bad:
            return bad
        for lo, hi in self._batches(group, int(obj_addrs.shape[0])):
            stage, shaped = self._staged(group, hi - lo)
            for i in range(lo, hi):
                stage[i - lo].copy_(host_bytes(int(obj_addrs[i]), size), non_blocking=True)
            obj, slot, block = self._index(moves, lo, hi)
            for layer, view in enumerate(self.views[group]):
                view[block] = shaped[obj, layer, slot]
        return []

    def gather(self, group: int, obj_addrs: np.ndarray, moves: Moves) -> list[int] | None:
        """Checksums come after `finish` (the host objects are written asynchronously): returns None."""
        size = self.layouts[group].object_bytes
        partial = len(moves) < int(obj_addrs.shape[0]) * self.layouts[group].blocks_per_chunk
        for lo, hi in self._batches(group, int(obj_addrs.shape[0])):
            stage, shaped = self._staged(group, hi - lo)
            if partial:  # a window snapshot that starts before token 0: its leading slots are zeros
                stage.zero_()
            obj, slot, block = self._index(moves, lo, hi)
            for layer, view in enumerate(self.views[group]):
                shaped[obj, layer, slot] = view[block]
            for i in range(lo, hi):
                host_bytes(int(obj_addrs[i]), size).copy_(stage[i - lo], non_blocking=True)
        return None

    def finish(self) -> None:
        if self.device.type == "cuda":
            synchronize(self.device)
