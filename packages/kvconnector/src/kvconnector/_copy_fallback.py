"""Pure-numpy twins of the `_kvcopy` kernels: same arguments, same checks, same results.

Why: the C++ extension is built by `uv sync`, but a host without a compiler (or a broken build) must
still work, byte for byte. Tests run both side by side, so this module is also the executable
specification of the checksum (kvsum64, defined in csrc/checksum.h and docs/layouts.md).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

MIN_BYTES_PER_THREAD = 1 << 20

_P1 = np.uint64(0x9E3779B97F4A7C15)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
_MASK = (1 << 64) - 1
_WORDS_PER_STEP = 1 << 18  # 2 MiB of input per vector step keeps temporaries cache-sized


def default_threads() -> int:
    """The fallback copies on the calling thread only."""
    return 1


def plan_threads(total_bytes: int, num_threads: int = 0) -> int:
    return 1


def _view(addr: int, length: int, writable: bool) -> np.ndarray:
    """A uint8 numpy view of `length` bytes at raw address `addr` (no copy, no ownership)."""
    if length == 0:
        return np.empty(0, dtype=np.uint8)
    arr = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(addr))
    if not writable:
        arr.flags.writeable = False
    return arr


def _segment_table(segments: Any) -> np.ndarray:
    """Reads segments the way the C++ binding does and returns an (n, 3) int64 array."""
    if isinstance(segments, np.ndarray):
        arr = segments
    else:
        mv = memoryview(segments)
        arr = np.frombuffer(mv, dtype=np.uint8) if mv.itemsize == 1 else np.asarray(mv)
    if arr.dtype.itemsize == 1 and arr.dtype.kind in "uiS":
        if not arr.flags.c_contiguous:
            raise ValueError("a bytes-like segment table must be C-contiguous")
        if arr.nbytes % 24 != 0:
            raise ValueError("a bytes-like segment table must hold whole int64 triples (24 bytes each)")
        return np.frombuffer(arr.tobytes(), dtype=np.int64).reshape(-1, 3)
    if arr.dtype.kind != "i" or arr.dtype.itemsize != 8 or arr.dtype.byteorder == ">":
        raise ValueError(f"segments must be int64 (or raw bytes), got dtype {arr.dtype}")
    if arr.ndim == 2:
        if arr.shape[1] != 3:
            raise ValueError(f"segments must have shape (n, 3), got second dimension {arr.shape[1]}")
        return arr
    if arr.ndim == 1:
        if arr.shape[0] % 3 != 0:
            raise ValueError("a 1-D segment array must hold a multiple of 3 values")
        return arr.reshape(-1, 3)
    raise ValueError(f"segments must be a (n, 3) array, got ndim {arr.ndim}")


def _check_address(base: int, off: int, length: int, i: int, side: str) -> int:
    addr = base + off
    if addr + length > _MASK:
        raise ValueError(f"segment {i}: {side} address overflows")
    if addr == 0 and length > 0:
        raise ValueError(f"segment {i}: {side} address is null")
    return addr


def batch_copy(src_base: int, dst_base: int, segments: Any, num_threads: int = 0) -> int:
    """Copy each (src_off, dst_off, len) row from src_base+src_off to dst_base+dst_off; return bytes."""
    if src_base < 0 or dst_base < 0:
        raise ValueError("base addresses must be >= 0")
    if num_threads < 0 or num_threads > 1024:
        raise ValueError("num_threads must be in [0, 1024]")
    table = _segment_table(segments)
    if table.size and (table < 0).any():
        i = int(np.flatnonzero((table < 0).any(axis=1))[0])
        raise ValueError(f"segment {i} has a negative value {tuple(int(v) for v in table[i])}")
    rows = [(i, int(s), int(d), int(n)) for i, (s, d, n) in enumerate(table.tolist()) if n > 0]
    total = 0
    for i, s, d, n in rows:  # validate everything before touching any byte, like the C++ binding
        _check_address(src_base, s, n, i, "source")
        _check_address(dst_base, d, n, i, "destination")
        total += n
        if total > 1 << 62:
            raise ValueError("total segment length is too large")
    if not rows:
        return 0
    # One view per side spanning every segment, then one numpy slice copy per segment.
    s_lo = min(s for _, s, _, _ in rows)
    s_hi = max(s + n for _, s, _, n in rows)
    d_lo = min(d for _, _, d, _ in rows)
    d_hi = max(d + n for _, _, d, n in rows)
    src = _view(src_base + s_lo, s_hi - s_lo, writable=False)
    dst = _view(dst_base + d_lo, d_hi - d_lo, writable=True)
    for _, s, d, n in rows:
        np.copyto(dst[d - d_lo : d - d_lo + n], src[s - s_lo : s - s_lo + n])
    return total


def _fmix(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser, in place on a uint64 array."""
    x ^= x >> _S33
    x *= _M1
    x ^= x >> _S33
    x *= _M2
    x ^= x >> _S33
    return x


def _fmix_int(x: int) -> int:
    return int(_fmix(np.array([x & _MASK], dtype=np.uint64))[0])


def _kvsum64(data: np.ndarray, seed: int) -> int:
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
            acc += _fmix_int(tail ^ seed ^ (((words + 1) * int(_P1)) & _MASK) ^ int(_P2))
    return _fmix_int((acc & _MASK) ^ seed ^ (((n + 1) * int(_P2)) & _MASK))


def _check_seed(seed: int) -> int:
    if not 0 <= seed <= _MASK:
        raise TypeError("seed must be an unsigned 64-bit integer")
    return int(seed)


def checksum(addr: int, length: int, seed: int = 0) -> int:
    """kvsum64 of `length` bytes at raw address `addr`."""
    seed = _check_seed(seed)
    if addr < 0 or length < 0:
        raise ValueError("addr and length must be >= 0")
    if length > 0 and addr == 0:
        raise ValueError("addr is null")
    if addr + length > _MASK:
        raise ValueError("addr + length overflows")
    return _kvsum64(_view(addr, length, writable=False), seed)


def checksum_bytes(buffer: Any, seed: int = 0) -> int:
    """kvsum64 of a contiguous bytes-like object."""
    seed = _check_seed(seed)
    mv = memoryview(buffer)
    if not mv.c_contiguous:
        raise ValueError("checksum_bytes needs a C-contiguous buffer")
    return _kvsum64(np.frombuffer(mv.cast("B") if mv.ndim != 1 or mv.itemsize != 1 else mv, dtype=np.uint8), seed)
