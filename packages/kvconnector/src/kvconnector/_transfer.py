"""Which engine blocks move to or from which object slots, and the host-memory copy that moves them.

Why its own module: the EngineClient decides *what* moves (a load may start in the middle of a chunk
object, at the first block the engine does not hold yet); this module turns that into block moves,
and the host copier turns moves into rows (`engine_kv.block_rows`) for the csrc `copy_checksum`
kernel. Objects are given by absolute host addresses (arena base + offset in shm mode, a received
frame or send buffer in tcp mode), so one kernel call serves every layer.

An object holds [layer][block-in-chunk][block_bytes] (see kvprotocol.LayoutDescriptor); inside a
block the runs (K and V for flash_attn) follow each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from . import copy as kvcopy
from .engine_kv import EngineKV, block_rows, object_table


@dataclass(frozen=True)
class Moves:
    """Block moves of one object group: object index, slot inside the object, engine block id."""

    obj: np.ndarray
    slot: np.ndarray
    block: np.ndarray

    def __len__(self) -> int:
        return int(self.block.shape[0])


def load_moves(block_table: np.ndarray, blocks_per_chunk: int, start_chunk: int, first_block: int,
               end_block: int) -> Moves:
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


def save_moves(block_table: np.ndarray, blocks_per_chunk: int, chunks: Sequence[int]) -> Moves:
    """Moves that fill whole objects, object i being chunk chunks[i] of the request."""
    c = np.asarray(chunks, dtype=np.int64)
    slot = np.tile(np.arange(blocks_per_chunk, dtype=np.int64), c.shape[0])
    obj = np.repeat(np.arange(c.shape[0], dtype=np.int64), blocks_per_chunk)
    j = c[obj] * blocks_per_chunk + slot
    if j.size and int(j.max()) >= block_table.shape[0]:
        raise ValueError("block_ids do not cover the chunks to save")
    return Moves(obj, slot, block_table[j])


def check_blocks(moves: Moves, num_blocks: int, *, distinct: bool) -> None:
    """Engine block ids must exist, and a scatter must not write one block twice."""
    b = moves.block
    if b.size and (int(b.min()) < 0 or int(b.max()) >= num_blocks):
        raise ValueError(f"block id out of range [0, {num_blocks})")
    if distinct and np.unique(b).size != b.size:
        raise ValueError("a block id appears twice in the load range")


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
    """KV in host memory: the csrc batch_copy kernel, one call per group and direction."""

    def __init__(self, groups: Sequence[EngineKV], keepalive: Any = None, num_threads: int = 0) -> None:
        self.groups = list(groups)
        self._keepalive = keepalive  # the engine's tensors: their addresses are in `groups`
        self.num_threads = num_threads

    def num_blocks(self, group: int) -> int:
        return self.groups[group].num_blocks

    def scatter(self, group: int, obj_addrs: np.ndarray, moves: Moves, expected: Sequence[int]) -> list[int]:
        kv = self.groups[group]
        got = kvcopy.copy_checksum(0, 0, block_rows(kv, obj_addrs, moves, False),
                                   object_table(obj_addrs, kv.layout.object_bytes), "src", self.num_threads)
        return [i for i, (g, e) in enumerate(zip(got, expected, strict=True)) if g != e]

    def gather(self, group: int, obj_addrs: np.ndarray, moves: Moves) -> list[int] | None:
        kv = self.groups[group]
        return kvcopy.copy_checksum(0, 0, block_rows(kv, obj_addrs, moves, True),
                                    object_table(obj_addrs, kv.layout.object_bytes), "dst", self.num_threads)

    def finish(self) -> None:
        return None

    def attach_arena(self, addr: int, size: int) -> None:
        return None

    def detach_arena(self) -> None:
        return None
