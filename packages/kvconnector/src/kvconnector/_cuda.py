"""The only GPU-specific code: pin host memory for DMA and wait for the engine's stream.

Why isolated: nothing here runs on a CPU-only host, so it is kept to a few calls that docs/engine.md
lists as untested until run on a GPU. Every function degrades instead of raising: an unpinned arena
still copies correctly, just synchronously.
"""

from __future__ import annotations

import logging

import torch

_log = logging.getLogger("kvconnector.cuda")


def pin_host(addr: int, size: int) -> bool:
    """cudaHostRegister the range (the shm arena) so host<->device copies are asynchronous DMA.

    Registering page-locks, and therefore commits, the whole range: size the arena for that.
    """
    try:
        cudart = torch.cuda.cudart()
        torch.cuda.check_error(cudart.cudaHostRegister(addr, size, 0))
        return True
    except Exception as exc:  # not fatal: copies fall back to pageable (synchronous) transfers
        _log.warning("could not pin the shm arena for DMA (%s); copies will be synchronous", exc)
        return False


def unpin_host(addr: int) -> None:
    try:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(addr))
    except Exception as exc:
        _log.warning("cudaHostUnregister failed: %s", exc)


def synchronize(device: torch.device) -> None:
    """Wait for the engine's current stream: the copies were issued on it, in order."""
    torch.cuda.current_stream(device).synchronize()
