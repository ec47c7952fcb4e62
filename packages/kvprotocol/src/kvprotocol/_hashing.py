"""Rolling prefix hash over token chunks: a chunk's key depends on every token before it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from blake3 import blake3

ZERO_HASH = bytes(32)
EXTRA_DIGEST_BYTES = 32  # one per-chunk extra key (adapter, multimodal items, ...): a 32-byte digest
ExtraKeys = Sequence[tuple[int, bytes]]  # (chunk index, digest), chunk indices strictly increasing
TOKEN_DTYPE = np.dtype("<u4")  # tokens on the wire: packed little-endian uint32


def pack_tokens(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Pack token ids as little-endian uint32 bytes (the wire form)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError("tokens must be one-dimensional")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32")
    return arr.astype(TOKEN_DTYPE, copy=False).tobytes()


def unpack_tokens(data: bytes | bytearray | memoryview) -> np.ndarray:
    """Inverse of `pack_tokens`; raises ValueError when the length is not a multiple of 4."""
    if len(data) % 4:
        raise ValueError("token bytes length must be a multiple of 4")
    return np.frombuffer(data, dtype=TOKEN_DTYPE)


def check_extra(extra: Iterable[tuple[int, bytes]], num_chunks: int | None = None) -> list[tuple[int, bytes]]:
    """Validate per-chunk extra keys: (index, 32-byte digest) pairs, indices strictly increasing.

    With num_chunks, every index must also be < num_chunks. Raises ValueError; returns a list.
    """
    out: list[tuple[int, bytes]] = []
    last = -1
    for item in extra:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError("an extra key is a (chunk index, digest) pair")
        index, digest = item
        if not isinstance(index, int) or isinstance(index, bool) or index <= last:
            raise ValueError("extra key chunk indices must be integers, strictly increasing")
        if not isinstance(digest, bytes) or len(digest) != EXTRA_DIGEST_BYTES:
            raise ValueError(f"an extra key digest is {EXTRA_DIGEST_BYTES} bytes")
        if num_chunks is not None and index >= num_chunks:
            raise IndexError(f"extra key for chunk {index} but only {num_chunks} full chunk(s)")
        out.append((index, digest))
        last = index
    return out


def chunk_hashes(tokens: Sequence[int] | np.ndarray | bytes, chunk_size: int,
                 extra: ExtraKeys = ()) -> list[bytes]:
    """32-byte rolling hashes of every full chunk.

    h_{-1} = 32 zero bytes; h_i = BLAKE3(h_{i-1} || tokens[iC:(i+1)C] as big-endian uint32 [|| x_i]),
    where x_i is chunk i's 32-byte extra digest when `extra` names chunk i (what else changes the KV
    of those tokens: a LoRA adapter, multimodal items; see docs/protocol.md). Chunks without one hash
    exactly as before, so plain requests keep their keys. The partial tail is not hashed (only full
    chunks are cached); an extra key beyond the last full chunk raises IndexError.
    """
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    arr = unpack_tokens(tokens) if isinstance(tokens, (bytes, bytearray, memoryview)) else np.asarray(tokens)
    n_full = arr.size // chunk_size
    extras = dict(check_extra(extra, n_full)) if extra else {}
    big_endian = arr[: n_full * chunk_size].astype(">u4").tobytes()
    step = chunk_size * 4
    out: list[bytes] = []
    prev = ZERO_HASH
    for i in range(n_full):
        prev = blake3(prev + big_endian[i * step : (i + 1) * step] + extras.get(i, b"")).digest()
        out.append(prev)
    return out
