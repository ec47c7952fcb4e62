"""The CUDA copier: block moves as torch index operations, for KV that lives on a GPU.

Why torch ops and not the csrc kernel: a GPU's KV cannot be reached with memcpy from the host. Each
transfer stages whole objects on the KV's device (one host<->device copy per object, asynchronous
when the host side is pinned, e.g. the cudaHostRegister'ed arena), then moves blocks with one
`index_put_` per layer.

Ordering (docs/engine.md "GPU KV"): copies run on a side stream of their own, which first waits for
the work the engine had queued on its compute stream when the copy was issued (a save reads blocks
that forward wrote; a load writes blocks an earlier step may still touch). `finish` waits, on the
calling thread, for an event recorded after the last copy: only then may a load's leases be released
(the server may reuse the bytes) or a save be committed (the server must see whole objects), and
vLLM be told that a load is done. The compute stream never waits for a copy.

The indexing is device-agnostic, so it is tested on CPU tensors (`copy_backend="torch"`), and the
ordering is tested with a recording `CopyStreams`; only `CudaStreams` and the host registration
(`HostPins`) call CUDA, kept to a few lines that docs/engine.md lists as untested until run on a GPU.
They degrade instead of raising: an unpinned arena still copies correctly, just synchronously.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from kvprotocol import LayoutDescriptor

from . import copy as kvcopy
from .engine_kv import Moves
from .layouts import tag_geometry

DEFAULT_STAGE_BYTES = 256 << 20  # device staging per step; bounds the transient device memory

_log = logging.getLogger("kvconnector.cuda")


def _cuda_register(addr: int, size: int) -> None:
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(addr, size, 0))


def _cuda_unregister(addr: int) -> None:
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(addr))


class HostPins:
    """Page-locks host ranges (the shm arena) for DMA, once per process however many copiers use them.

    Why counted: a vLLM worker has two EngineClients (the step's and the background loader's), each
    with a copier over the same arena mapping; registering a range twice fails, and the first copier
    to let go must not unregister it under the other."""

    def __init__(
        self,
        register: Callable[[int, int], None] = _cuda_register,
        unregister: Callable[[int], None] = _cuda_unregister,
    ) -> None:
        self._register, self._unregister = register, unregister
        self._lock = threading.Lock()
        self._users: dict[int, int] = {}  # address -> copiers holding it

    def pin(self, addr: int, size: int) -> bool:
        """Register (first user) or count another user; False (logged) when registration failed."""
        with self._lock:
            if addr in self._users:
                self._users[addr] += 1
                return True
            try:
                self._register(addr, size)
            except Exception as exc:  # not fatal: copies fall back to pageable (synchronous) transfers
                _log.warning("could not pin the shm arena for DMA (%s); copies will be synchronous", exc)
                return False
            self._users[addr] = 1
            return True

    def unpin(self, addr: int) -> None:
        """Uncount a user; the last one unregisters the range."""
        with self._lock:
            left = self._users.get(addr, 0) - 1
            if left > 0:
                self._users[addr] = left
                return
            self._users.pop(addr, None)
            if left < 0:
                return
            try:
                self._unregister(addr)
            except Exception as exc:
                _log.warning("cudaHostUnregister failed: %s", exc)

    def users(self, addr: int) -> int:
        with self._lock:
            return self._users.get(addr, 0)


PINS = HostPins()


def pin_host(addr: int, size: int) -> bool:
    """cudaHostRegister the range (the shm arena) so host<->device copies are asynchronous DMA.

    Registering page-locks, and therefore commits, the whole range: size the arena for that.
    """
    return PINS.pin(addr, size)


def unpin_host(addr: int) -> None:
    PINS.unpin(addr)


class CopyStreams(Protocol):
    """Where a copier's device work is issued and how its completion is awaited."""

    def issue(self) -> contextlib.AbstractContextManager[None]:
        """Enter to issue copies: ordered after the work queued on the compute stream so far."""
        ...

    def complete(self) -> None:
        """Return once every copy issued so far has completed (blocks the calling thread only)."""
        ...


class InlineStreams:
    """Host tensors: torch runs each copy before returning, so there is nothing to order or await."""

    @contextlib.contextmanager
    def issue(self) -> Iterator[None]:
        yield

    def complete(self) -> None:
        return None


class CudaStreams:
    """A side stream per copier, ordered after the compute stream it was created on."""

    def __init__(self, device: torch.device) -> None:
        # Captured on the thread that registers the KV (vLLM's engine thread): the stream its forward
        # runs on. A background save or load thread has a current stream of its own.
        self.compute = torch.cuda.current_stream(device)
        self.side = torch.cuda.Stream(device)

    @contextlib.contextmanager
    def issue(self) -> Iterator[None]:
        self.side.wait_stream(self.compute)
        with torch.cuda.stream(self.side):
            yield

    def complete(self) -> None:
        done = torch.cuda.Event()
        done.record(self.side)
        done.synchronize()


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
        self,
        layouts: Sequence[LayoutDescriptor],
        groups: Sequence[Any],
        stage_bytes: int = DEFAULT_STAGE_BYTES,
        streams: CopyStreams | None = None,
        pins: HostPins = PINS,
    ) -> None:
        self.layouts = list(layouts)
        self.views = [block_views(lay, g) for lay, g in zip(self.layouts, groups, strict=True)]
        self.device = self.views[0][0].device
        if streams is None:
            streams = CudaStreams(self.device) if self.device.type == "cuda" else InlineStreams()
        self.streams = streams
        self.pins = pins
        self.stage_bytes = stage_bytes
        self._pinned: int | None = None

    def num_blocks(self, group: int) -> int:
        return int(self.views[group][0].shape[0])

    def attach_arena(self, addr: int, size: int) -> None:
        """Pin the arena for asynchronous DMA when the KV is on a GPU."""
        if self.device.type == "cuda" and self._pinned is None and self.pins.pin(addr, size):
            self._pinned = addr

    def detach_arena(self) -> None:
        if self._pinned is not None:
            self.pins.unpin(self._pinned)
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
        with self.streams.issue():
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
        with self.streams.issue():
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
        """Every copy issued so far has completed (the side stream's event, not the compute stream)."""
        self.streams.complete()
