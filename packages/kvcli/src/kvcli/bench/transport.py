"""Moving object bytes the two ways a kvserver offers: ZMQ frames (tcp) or its shared arena (shm).

An engine would gather its paged KV into these buffers; the bench fills them from a random pool
and stamps each object with its chunk hash, so a retrieve can prove it got the right bytes back.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from kvprotocol._shm import ShmMapping

STAMP = 32  # bytes of chunk hash at the head of each object


class Payload:
    """Object contents: a shared random body with a per-chunk stamp at its head."""

    def __init__(self, object_bytes: int, seed: int = 0) -> None:
        if object_bytes < STAMP:
            raise ValueError(f"objects must hold at least {STAMP} bytes")
        self.size = object_bytes
        self.body = np.random.default_rng(seed).integers(0, 256, size=object_bytes, dtype=np.uint8)

    def make(self, stamp: bytes) -> np.ndarray:
        buf = self.body.copy()
        buf[:STAMP] = np.frombuffer(stamp, dtype=np.uint8)
        return buf

    def check(self, data: np.ndarray, stamp: bytes, full: bool) -> bool:
        if data.size != self.size or data[:STAMP].tobytes() != stamp:
            return False
        return not full or bool(np.array_equal(data[STAMP:], self.body[STAMP:]))


class Arena:
    """The server's L1 segment mapped into this process (shm mode: same host only)."""

    def __init__(self, name: str, size: int) -> None:
        self._map = ShmMapping(name, size)
        self.view = np.frombuffer(self._map.mm, dtype=np.uint8)

    def write(self, offset: int, data: np.ndarray) -> None:
        self.view[offset : offset + data.size] = data

    def read_into(self, offset: int, out: np.ndarray) -> None:
        np.copyto(out, self.view[offset : offset + out.size])

    def close(self) -> None:
        del self.view
        self._map.close()


def frames_to_arrays(frames: list[Any]) -> list[np.ndarray]:
    return [np.frombuffer(f, dtype=np.uint8) for f in frames]
