"""Eviction policies for L1: one file each, behind `EvictionPolicy`."""

from typing import Any

from .arc import ARCPolicy
from .base import EvictionPolicy
from .lfu import LFUPolicy
from .lhd import LHDPolicy
from .lru import LRUPolicy
from .s3fifo import S3FIFOPolicy
from .slru import SLRUPolicy

POLICIES: dict[str, type[EvictionPolicy[Any]]] = {
    p.name: p for p in (LRUPolicy, LFUPolicy, ARCPolicy, S3FIFOPolicy, SLRUPolicy, LHDPolicy)
}


def make_policy(name: str) -> EvictionPolicy[Any]:
    """A fresh policy by name; its key type is its owner's (an L1Cache makes it EvictionPolicy[ObjectKey])."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose from {sorted(POLICIES)}") from None


__all__ = [
    "ARCPolicy",
    "EvictionPolicy",
    "LFUPolicy",
    "LHDPolicy",
    "LRUPolicy",
    "POLICIES",
    "S3FIFOPolicy",
    "SLRUPolicy",
    "make_policy",
]
