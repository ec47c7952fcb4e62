"""What EngineClient calls return, and how it reads the token and block-id arguments it is given.

Plain frozen dataclasses: a failure is a result with `error` set (an engine never sees an exception
from the cache), so callers can branch on fields instead of catching.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    TokenIds = Sequence[int] | np.ndarray | torch.Tensor  # one-dimensional
    # One block table for every object group, or one per group (vLLM's tuple of lists)
    BlockIds = Sequence[int] | Sequence[Sequence[int] | np.ndarray] | np.ndarray | torch.Tensor

__all__ = ["LoadResult", "LookupResult", "SaveResult", "as_tables", "as_tokens"]


@dataclass(frozen=True, slots=True)
class LookupResult:
    hit_tokens: int
    error: str | None = None
    pending: bool = False  # wait=False only: an L2 prefetch runs; ask again later for a bigger hit
    inflight: bool = False  # a producer's reservation is writing the chunk the hit stops at (docs/pd.md)
    # expect=True and pending only: the tokens L1 + the running L2 prefetch will cover once it landed
    # (EngineClient.load_streamed loads them as they land); None: not known
    expected_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class LoadResult:
    ok: bool
    loaded_tokens: int
    failed_block_ids: list[int] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True, slots=True)
class SaveResult:
    ok: bool
    saved_chunks: int
    error: str | None = None
    cached_chunks: int = 0  # chunks of the range now cached, written by this call or already present
    # The server had no room for some chunk (NO_SPACE): the cache is full, the server is fine. What
    # fitted is stored (saved_chunks); callers must not treat this as a server failure.
    no_space: bool = False
    # A whole-request reservation does not fit now (RETRY_LATER): nothing was stored; save again later.
    retry_later: bool = False


def as_tokens(tokens: TokenIds) -> np.ndarray:
    """Token ids from a list, numpy array or torch tensor, as a 1-D integer array."""
    if hasattr(tokens, "detach"):
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError("tokens must be one-dimensional")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got {arr.dtype}")
    return arr


def as_tables(block_ids: BlockIds, groups: int) -> list[np.ndarray]:
    """One block table per group: a flat list serves every group, a nested one is per group."""
    if hasattr(block_ids, "detach"):
        block_ids = block_ids.detach().cpu().numpy()
    nested = (isinstance(block_ids, np.ndarray) and block_ids.ndim == 2) or (
        not isinstance(block_ids, np.ndarray)
        and len(block_ids) > 0
        and isinstance(block_ids[0], (list, tuple, np.ndarray))
    )
    tables = (
        [np.asarray(t, dtype=np.int64).reshape(-1) for t in block_ids]
        if nested
        else [np.asarray(block_ids, dtype=np.int64).reshape(-1)] * groups
    )
    if len(tables) != groups:
        raise ValueError(f"{len(tables)} block tables for {groups} object groups")
    return tables
