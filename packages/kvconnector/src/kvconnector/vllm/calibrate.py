"""A first estimate of what a load costs, measured once when a worker registers its KV tensors.

Why: the load planner (costs.py) compares the load rate with the prefill rate. Learned from real
loads only, its first decisions would rest on no measurement at all. A load is two round trips to
the server (retrieve, release) and, per chunk, a copy of the chunk's bytes into the engine's blocks
with a checksum pass over them. The calibration times a ping and a copy of one chunk's worth of
bytes out of the KV tensors into a host scratch buffer: no cache traffic, nothing stored or read from
the arena. The round trips are a load's fixed part, the copy its part per token (costs.LoadRate).
Real loads replace the estimate within a few samples (exponential smoothing).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvprotocol import LayoutDescriptor

if TYPE_CHECKING:
    import torch

    from ..engine_client import EngineClient

REPEATS = 3


@dataclass(frozen=True)
class LoadCalibration:
    """One estimated load of one chunk: `fixed_s` for its round trips, `copy_s` for its chunk's bytes."""

    fixed_s: float
    tokens: int
    copy_s: float

    @property
    def seconds(self) -> float:
        return self.fixed_s + self.copy_s


def calibrate_load(
    client: EngineClient, tensors: list[torch.Tensor], layout: LayoutDescriptor
) -> LoadCalibration | None:
    """One chunk's estimated load, or None when it cannot be measured here."""
    if not tensors or any(not t.is_contiguous() for t in tensors):
        return None
    rtts = [client.round_trip() for _ in range(REPEATS)]
    if any(r is None for r in rtts):
        return None  # server down: the breaker and the first real loads take over
    per_tensor = layout.object_bytes // len(tensors)
    copy_s = 0.0
    for t in tensors:
        n = min(t.numel(), per_tensor // max(1, t.element_size()))
        src = t.reshape(-1)[:n]
        # a host buffer: on a GPU a load's bytes cross the host<->device link (a copy into pageable
        # memory returns once it is done, so the time is the copy's, not its launch's)
        dst = src.new_empty(n, device="cpu")
        best = float("inf")
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
        copy_s += best
    # a load: retrieve and release (two round trips); the copy and a checksum pass over the bytes
    return LoadCalibration(2 * min(r for r in rtts if r is not None), layout.chunk_size, 2 * copy_s)
