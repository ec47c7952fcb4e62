"""Rolling prefix hash over token chunks: a chunk's key depends on every token before it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from blake3 import blake3

ZERO_HASH = bytes(32)
TOKEN_DTYPE = np.dtype("<u4")  # tokens on the wire: packed little-endian uint32


def pack_tokens(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Pack token ids as little-endian uint32 bytes (the wire form)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError("tokens must be one-dimensional")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32")
    return arr.astype(TOKEN_DTYPE, copy=False).tobytes()


def unpack_tokens(data: bytes) -> np.ndarray:
    """Inverse of `pack_tokens`; raises ValueError when the length is not a multiple of 4."""
    if len(data) % 4:
        raise ValueError("token bytes length must be a multiple of 4")
    return np.frombuffer(data, dtype=TOKEN_DTYPE)


def chunk_hashes(tokens: Sequence[int] | np.ndarray | bytes, chunk_size: int) -> list[bytes]:
    """32-byte rolling hashes of every full chunk.

    h_{-1} = 32 zero bytes; h_i = BLAKE3(h_{i-1} || tokens[iC:(i+1)C] as big-endian uint32).
    The partial tail is not hashed (only full chunks are cached).
    """
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    arr = unpack_tokens(tokens) if isinstance(tokens, (bytes, bytearray, memoryview)) else np.asarray(tokens)
    n_full = arr.size // chunk_size
    big_endian = arr[: n_full * chunk_size].astype(">u4").tobytes()
    step = chunk_size * 4
    out: list[bytes] = []
    prev = ZERO_HASH
    for i in range(n_full):
        prev = blake3(prev + big_endian[i * step : (i + 1) * step]).digest()
        out.append(prev)
    return out
