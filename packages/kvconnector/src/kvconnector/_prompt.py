"""What one transfer of an engine rank is about: the request's tokens, block tables and keys."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from kvprotocol import ExtraKeys, check_extra


@dataclass(frozen=True)
class Prompt:
    """What a load or save is about: the request's tokens, its block table per group, and what else
    keys its chunks (salt, extra keys)."""

    tokens: np.ndarray
    tables: Sequence[np.ndarray]
    salt: str = ""
    extra: ExtraKeys = ()


def extra_pairs(extra: ExtraKeys, num_chunks: int) -> list[tuple[int, bytes]] | None:
    """The wire `extra` field for a request of num_chunks full chunks (keys of later chunks dropped)."""
    pairs = [(i, d) for i, d in check_extra(extra) if i < num_chunks]
    return pairs or None


__all__ = ["Prompt", "extra_pairs"]
