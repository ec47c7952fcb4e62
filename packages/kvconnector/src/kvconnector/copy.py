"""Public copy API: batched segment copy and kvsum64 checksums over raw addresses.

Why one front door: callers (EngineClient, the vLLM connector, the bench) should not care whether
the C++ extension built. The backend is chosen once, at import: the `_kvcopy` extension when it
imports, else the numpy fallback (identical results, slower), announced by one log line.
`KVCONNECTOR_FORCE_FALLBACK=1` forces the fallback (tests, comparisons).

Addresses are plain ints. `address_of` gets them from numpy arrays, torch tensors and bytes-like
buffers (mmap, shared memory); the caller must keep those objects alive while a copy runs.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from . import _copy_fallback

if TYPE_CHECKING:
    import mmap

    import torch
    from typing_extensions import TypeIs

    HostBuffer = bytes | bytearray | memoryview | mmap.mmap  # shm.buf is a memoryview
    Memory = torch.Tensor | np.ndarray | HostBuffer
    Rows = np.ndarray | HostBuffer  # int64 rows: an array, or a contiguous bytes-like of native int64s

_log = logging.getLogger("kvconnector")

FORCE_FALLBACK_ENV = "KVCONNECTOR_FORCE_FALLBACK"


def _select_backend() -> tuple[ModuleType, str]:
    if os.environ.get(FORCE_FALLBACK_ENV, "").strip() not in ("", "0"):
        _log.info("kvconnector copy backend: numpy fallback (forced by %s)", FORCE_FALLBACK_ENV)
        return _copy_fallback, "numpy-fallback"
    try:
        from . import _kvcopy  # type: ignore[attr-defined]  # the compiled extension (csrc/)
    except ImportError as exc:  # not built, or built for another interpreter
        _log.warning("kvconnector copy backend: C++ extension unavailable (%s); using the numpy fallback", exc)
        return _copy_fallback, "numpy-fallback"
    return _kvcopy, "cpp"


_backend, _backend_name = _select_backend()


def backend_name() -> str:
    """ "cpp" (the `_kvcopy` extension) or "numpy-fallback"."""
    return _backend_name


def batch_copy(src_base: int, dst_base: int, segments: Rows, num_threads: int = 0) -> int:
    """Copy every row (src_off, dst_off, len) of `segments`: len bytes from src_base+src_off to
    dst_base+dst_off. Returns the total bytes copied.

    `segments` is an (n, 3) int64 array (or a 1-D int64 array of 3n values, or a contiguous bytes-like
    of native int64 triples). Bad shape, dtype or negative values raise ValueError before any byte
    moves. Destinations must not overlap each other or any source. `num_threads=0` picks
    min(cores, 8) for large copies; copies under 1 MiB per thread stay on the calling thread. The C++
    backend releases the GIL while copying.
    """
    return int(_backend.batch_copy(src_base, dst_base, segments, num_threads))


def copy_checksum(
    src_base: int, dst_base: int, segments: Rows, objects: Rows, object_side: str, num_threads: int = 0, seed: int = 0
) -> list[int]:
    """`batch_copy`, fused with the kvsum64 of every object, summed from the bytes as they are copied.

    `objects`: (m, 2) int64 rows (offset, length) from the base of `object_side`: "dst" for a gather
    (engine -> objects: the checksum of each object as written), "src" for a scatter (objects ->
    engine: the checksum of each object as read). Every segment's object side must lie inside the
    objects, and no object byte may be covered twice; object bytes no segment covers are summed from
    the object. Results equal `checksum` of each object after the copy, whatever the thread count.
    """
    return [
        int(v) for v in _backend.copy_checksum(src_base, dst_base, segments, objects, object_side, num_threads, seed)
    ]


def checksum(addr: int, length: int, seed: int = 0) -> int:
    """kvsum64 (a 64-bit non-cryptographic checksum, see docs/layouts.md) of `length` bytes at `addr`."""
    return int(_backend.checksum(addr, length, seed))


def checksum_bytes(buffer: np.ndarray | HostBuffer, seed: int = 0) -> int:
    """kvsum64 of a C-contiguous bytes-like object (bytes, bytearray, memoryview, numpy array, mmap)."""
    return int(_backend.checksum_bytes(buffer, seed))


def default_threads() -> int:
    """Threads the active backend uses for a large copy with num_threads=0."""
    return int(_backend.default_threads())


def _is_tensor(obj: Memory) -> TypeIs[torch.Tensor]:
    """A torch.Tensor, told without importing torch."""
    return hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous") and hasattr(obj, "element_size")


def address_of(obj: Memory, *, writable: bool = False) -> int:
    """Base address of a torch tensor, numpy array or bytes-like buffer (mmap, shm.buf, bytearray).

    With `writable=True`, refuses read-only memory (e.g. `bytes`, read-only arrays) so it can serve as
    a copy destination. The address is valid only while `obj` (and, for mmap, its mapping) lives.
    """
    if _is_tensor(obj):
        if obj.device.type != "cpu":
            raise ValueError(f"address_of needs host memory, got a tensor on {obj.device}")
        return int(obj.data_ptr())
    if isinstance(obj, np.ndarray):
        arr = obj
    else:
        try:
            arr = np.frombuffer(obj, dtype=np.uint8)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"cannot take the address of {type(obj).__name__}: {exc}") from exc
    if writable and not arr.flags.writeable:
        raise ValueError(f"{type(obj).__name__} memory is read-only")
    return int(arr.__array_interface__["data"][0])


def nbytes_of(obj: Memory) -> int:
    """Size in bytes of a torch tensor's storage view, numpy array or bytes-like buffer."""
    if _is_tensor(obj):
        return int(obj.numel() * obj.element_size())
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    return int(memoryview(obj).nbytes)
