"""Pure-numpy twins of the `_kvcopy` kernels: same arguments, same checks, same results.

Why: the C++ extension is built by `uv sync`, but a host without a compiler (or a broken build) must
still work, byte for byte. Tests run both side by side, so this module is also the executable
specification of the checksum (kvsum64, defined in csrc/checksum.h and docs/layouts.md).
"""

from __future__ import annotations

import ctypes
import itertools
from typing import Any

import numpy as np
from kvprotocol.kvsum import kvsum64_array as _kvsum64

_MASK = (1 << 64) - 1


def default_threads() -> int:
    """The fallback copies on the calling thread only."""
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


def _rows(src_base: int, dst_base: int, segments: Any, num_threads: int) -> list[tuple[int, int, int, int]]:
    """The checked (row index, src_off, dst_off, len) rows with len > 0, as the C++ binding checks them."""
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
    return rows


def _copy_rows(src_base: int, dst_base: int, rows: list[tuple[int, int, int, int]]) -> int:
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
    return sum(n for *_, n in rows)


def batch_copy(src_base: int, dst_base: int, segments: Any, num_threads: int = 0) -> int:
    """Copy each (src_off, dst_off, len) row from src_base+src_off to dst_base+dst_off; return bytes."""
    return _copy_rows(src_base, dst_base, _rows(src_base, dst_base, segments, num_threads))


def _object_table(objects: Any) -> list[tuple[int, int]]:
    arr = np.asarray(objects) if isinstance(objects, np.ndarray) else None
    if arr is None:
        mv = memoryview(objects)
        arr = np.frombuffer(mv, dtype=np.int64) if mv.itemsize == 1 else np.asarray(mv)
    if arr.dtype.kind != "i" or arr.dtype.itemsize != 8:
        raise ValueError(f"objects must be int64, got dtype {arr.dtype}")
    if arr.size % 2 or (arr.ndim == 2 and arr.shape[1] != 2) or arr.ndim > 2:
        raise ValueError("objects must have shape (n, 2)")
    return [(int(o), int(n)) for o, n in arr.reshape(-1, 2).tolist()]


def _check_cover(
    rows: list[tuple[int, int, int, int]], objs: list[tuple[int, int]], src_base: int, dst_base: int, is_dst: bool
) -> None:
    """The checks of the C++ plan: disjoint objects, segments inside them, no object byte twice."""
    base = dst_base if is_dst else src_base
    spans = sorted((base + o, base + o + n, k) for k, (o, n) in enumerate(objs))
    for (_, end, _), (start, _, _) in itertools.pairwise(spans):
        if end > start:
            raise ValueError("objects overlap")
    starts = [s for s, _, _ in spans]
    covered: list[list[tuple[int, int]]] = [[] for _ in objs]
    for i, s, d, n in rows:
        at = base + (d if is_dst else s)
        while n > 0:
            j = int(np.searchsorted(starts, at, side="right")) - 1
            if j < 0 or at >= spans[j][1]:
                raise ValueError(f"segment {i}: its object side is in no object")
            lo, hi, k = spans[j]
            take = min(n, hi - at)
            covered[k].append((at - lo, at - lo + take))
            at += take
            n -= take
    for c in covered:
        c.sort()
        for (_, b), (a, _) in itertools.pairwise(c):
            if a < b:
                raise ValueError("two segments cover the same object bytes")


def copy_checksum(
    src_base: int, dst_base: int, segments: Any, objects: Any, object_side: str, num_threads: int = 0, seed: int = 0
) -> list[int]:
    """batch_copy, then the kvsum64 of every object: the C++ kernel's results, computed plainly."""
    seed = _check_seed(seed)
    if object_side not in ("dst", "src"):
        raise ValueError("object_side must be 'dst' or 'src'")
    rows = _rows(src_base, dst_base, segments, num_threads)
    objs = _object_table(objects)
    base = dst_base if object_side == "dst" else src_base
    for k, (o, n) in enumerate(objs):
        if o < 0 or n < 0:
            raise ValueError(f"object {k} has a negative value")
        _check_address(base, o, n, k, "object")
    _check_cover(rows, objs, src_base, dst_base, object_side == "dst")
    _copy_rows(src_base, dst_base, rows)
    return [_kvsum64(_view(base + o, n, writable=False), seed) for o, n in objs]


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
