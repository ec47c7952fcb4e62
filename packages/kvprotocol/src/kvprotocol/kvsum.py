"""kvsum64, the object checksum every tier carries: the one numpy definition.

Why here: an object's checksum is computed by the engine while it gathers (the csrc kernel), kept by
the server (L1 entry, L2 blob header) and checked by every reader. Torch-free writers (kvcli bench,
tests that store raw bytes) need the same function without kvconnector, so the reference
implementation lives in the protocol package; kvconnector's numpy fallback uses this one, and
tests check it against the C++ kernels byte for byte. Definition: csrc/checksum.h, docs/layouts.md.
Not imported by `kvprotocol/__init__` (numpy stays off the import path of clients that never sum).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

try:
    import numpy as np
except ImportError as exc:  # the one kvprotocol module that needs numpy; see the `kvsum` extra
    raise ImportError("kvprotocol.kvsum needs numpy: install kvprotocol[kvsum] (or numpy)") from exc

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12 (numpy arrays are one there)

MASK = (1 << 64) - 1
P1 = 0x9E3779B97F4A7C15
P2 = 0xC2B2AE3D27D4EB4F
_P1 = np.uint64(P1)
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
_WORDS_PER_STEP = 1 << 18  # 2 MiB of input per vector step keeps temporaries cache-sized


def _fmix(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser, in place on a uint64 array."""
    x ^= x >> _S33
    x *= _M1
    x ^= x >> _S33
    x *= _M2
    x ^= x >> _S33
    return x


def _fmix_int(x: int) -> int:
    return int(_fmix(np.array([x & MASK], dtype=np.uint64))[0])


def kvsum64_array(data: np.ndarray, seed: int = 0) -> int:
    """kvsum64 of a 1-D uint8 array (any alignment)."""
    n = int(data.shape[0])
    words = n // 8
    seed_u = np.uint64(seed)
    acc = 0
    with np.errstate(over="ignore"):
        for start in range(0, words, _WORDS_PER_STEP):
            stop = min(words, start + _WORDS_PER_STEP)
            w = data[start * 8 : stop * 8].view("<u8").astype(np.uint64)  # copy: aligned, native
            keys = np.arange(start + 1, stop + 1, dtype=np.uint64)
            keys *= _P1
            w ^= keys
            w ^= seed_u
            acc += int(_fmix(w).sum(dtype=np.uint64))
        rest = n % 8
        if rest:
            tail = int.from_bytes(data[words * 8 :].tobytes(), "little")
            acc += _fmix_int(tail ^ seed ^ (((words + 1) * P1) & MASK) ^ P2)
    return _fmix_int((acc & MASK) ^ seed ^ (((n + 1) * P2) & MASK))


def kvsum64(buffer: Buffer | np.ndarray, seed: int = 0) -> int:
    """kvsum64 of a C-contiguous bytes-like object (bytes, memoryview, numpy array, mmap)."""
    if not 0 <= seed <= MASK:
        raise TypeError("seed must be an unsigned 64-bit integer")
    mv = buffer.data if isinstance(buffer, np.ndarray) else memoryview(buffer)
    if not mv.c_contiguous:
        raise ValueError("kvsum64 needs a C-contiguous buffer")
    flat = mv.cast("B") if mv.ndim != 1 or mv.itemsize != 1 else mv
    return kvsum64_array(np.frombuffer(flat, dtype=np.uint8), seed)
