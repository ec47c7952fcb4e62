"""Rolling prefix hash over token chunks: a chunk's key depends on every token before it.

Pure Python plus the C-level `array` module: clients that only ping, describe or query never pay
numpy's import (about half a second cold). A numpy array passed in is converted by numpy itself
(the caller already imported it), so engines keep their vectorised path.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from blake3 import blake3

ZERO_HASH = bytes(32)
EXTRA_DIGEST_BYTES = 32  # one per-chunk extra key (adapter, multimodal items, ...): a 32-byte digest
ExtraKeys = Sequence[tuple[int, bytes]]  # (chunk index, digest), chunk indices strictly increasing


class TokenArray(Protocol):
    """A one-dimensional array of token ids that numpy reads (a numpy array, a CPU tensor): numpy
    converts it (`numpy.asarray`), so engines keep their vectorised path."""

    def __len__(self) -> int: ...

    def __getitem__(self, key: slice, /) -> TokenArray: ...

    def __array__(self) -> object: ...


Tokens = Sequence[int] | bytes | TokenArray  # token ids, or their packed little-endian uint32 bytes
_U32 = "I" if array("I").itemsize == 4 else "L"  # tokens on the wire: packed little-endian uint32
_LITTLE = sys.byteorder == "little"


def _is_ndarray(obj: Any) -> bool:
    return type(obj).__module__ == "numpy" and hasattr(obj, "astype")


def _u32_array(tokens: Any) -> array[int]:
    """Token ids as a native uint32 array; ValueError when one does not fit in uint32."""
    if isinstance(tokens, array) and tokens.typecode == _U32:
        return tokens
    if not _is_ndarray(tokens) and hasattr(tokens, "__array__"):  # a tensor: its caller has numpy already
        import numpy

        tokens = numpy.asarray(tokens)
    if _is_ndarray(tokens):
        out = array(_U32)
        out.frombytes(_ndarray_u32(tokens, "=u4"))
        return out
    try:
        return array(_U32, tokens)
    except OverflowError:
        raise ValueError("token ids must fit in uint32") from None
    except TypeError:
        raise ValueError("tokens must be a one-dimensional sequence of integers") from None


def _ndarray_u32(tokens: Any, dtype: str) -> bytes:
    """A 1-D numpy array's token ids as uint32 bytes of `dtype` (its byte order); ValueError when one
    does not fit. An unsigned array of at most 4-byte items cannot hold one that does not fit: no
    range pass over it (a 4096-token prompt: 4 of its 7 us)."""
    if tokens.ndim != 1:
        raise ValueError("tokens must be one-dimensional")
    kind, size = tokens.dtype.kind, tokens.dtype.itemsize
    if tokens.size and not (kind in "ub" and size <= 4) and (tokens.min() < 0 or tokens.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32")
    return tokens.astype(dtype, copy=False).tobytes()


def pack_tokens(tokens: Sequence[int] | TokenArray) -> bytes:
    """Pack token ids (a sequence of ints or a 1-D numpy array) as little-endian uint32 bytes (the wire form)."""
    if _is_ndarray(tokens):  # numpy converts and orders the bytes itself: one copy
        return _ndarray_u32(tokens, "<u4")
    arr = _u32_array(tokens)
    if not _LITTLE:
        arr = array(_U32, arr)
        arr.byteswap()
    return arr.tobytes()


def unpack_tokens(data: bytes | bytearray | memoryview) -> Sequence[int]:
    """Inverse of `pack_tokens`: a read-only sequence of ints (zero-copy on little-endian hosts).

    Raises ValueError when the length is not a multiple of 4.
    """
    if len(data) % 4:
        raise ValueError("token bytes length must be a multiple of 4")
    if _LITTLE:
        raw = memoryview(data).cast("B")
        return raw.cast("I") if _U32 == "I" else raw.cast("L")
    out = array(_U32)
    out.frombytes(bytes(data))
    out.byteswap()
    return out


def big_endian_tokens(tokens: Tokens, count: int | None = None) -> bytes:
    """The first `count` tokens (all by default) as big-endian uint32 bytes, the form chunks are hashed in."""
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        if len(tokens) % 4:
            raise ValueError("token bytes length must be a multiple of 4")
        raw = bytes(tokens) if count is None else bytes(tokens[: 4 * count])
        arr = array(_U32)
        arr.frombytes(raw)
        if _LITTLE:
            arr.byteswap()
        return arr.tobytes()
    arr = _u32_array(tokens if count is None else tokens[:count])
    if _LITTLE:
        arr = array(_U32, arr) if arr is tokens else arr
        arr.byteswap()
    return arr.tobytes()


def token_count(tokens: Tokens) -> int:
    return len(tokens) // 4 if isinstance(tokens, (bytes, bytearray, memoryview)) else len(tokens)


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


def chunk_hashes(
    tokens: Tokens,
    chunk_size: int,
    extra: ExtraKeys = (),
    *,
    start: int = 0,
    prev: bytes = ZERO_HASH,
) -> list[bytes]:
    """32-byte rolling hashes of every full chunk.

    h_{-1} = 32 zero bytes; h_i = BLAKE3(h_{i-1} || tokens[iC:(i+1)C] as big-endian uint32 [|| x_i]),
    where x_i is chunk i's 32-byte extra digest when `extra` names chunk i (what else changes the KV
    of those tokens: a LoRA adapter, multimodal items; see docs/protocol.md). Chunks without one hash
    exactly as before, so plain requests keep their keys. The partial tail is not hashed (only full
    chunks are cached); an extra key beyond the last full chunk raises IndexError.

    With `start` and `prev` (h_{start-1}, known already), only the hashes of chunks start.. are
    computed and returned: the chain continued, e.g. after a memo of its head (kvserver).
    """
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    if start < 0 or len(prev) != len(ZERO_HASH):
        raise ValueError("start must be >= 0 and prev a 32-byte hash")
    n_full = token_count(tokens) // chunk_size
    extras = dict(check_extra(extra, n_full)) if extra else {}
    if start >= n_full:
        return []
    if start:
        first = start * chunk_size
        tokens = tokens[4 * first :] if isinstance(tokens, (bytes, bytearray, memoryview)) else tokens[first:]
    big_endian = memoryview(big_endian_tokens(tokens, (n_full - start) * chunk_size))
    step = chunk_size * 4
    out: list[bytes] = []
    for i in range(n_full - start):
        h = blake3(prev)
        h.update(big_endian[i * step : (i + 1) * step])
        digest = extras.get(start + i)
        if digest is not None:
            h.update(digest)
        prev = h.digest()
        out.append(prev)
    return out


TAIL_DOMAIN = b"kvserver.tail.v1"  # a tail's hash input starts here: never the input of a chunk's hash


def tail_hash(tokens: Tokens, prev: bytes = ZERO_HASH) -> bytes:
    """32-byte hash of a partial last chunk (a *tail*: 1 to chunk_size - 1 tokens) after the chunk
    hashed `prev` (h_{i-1}; 32 zero bytes for a tail at chunk 0).

    t = BLAKE3(TAIL_DOMAIN || len as big-endian uint32 || h_{i-1} || tokens as big-endian uint32).
    Domain and length come first, so no tail hashes like a full chunk or like a tail of another
    length. Tails take no extra keys (a request with any is never stored or found as a tail)."""
    n = token_count(tokens)
    if n <= 0 or len(prev) != len(ZERO_HASH):
        raise ValueError("a tail has at least one token and prev is a 32-byte hash")
    h = blake3(TAIL_DOMAIN)
    h.update(n.to_bytes(4, "big"))
    h.update(prev)
    h.update(big_endian_tokens(tokens))
    return h.digest()
