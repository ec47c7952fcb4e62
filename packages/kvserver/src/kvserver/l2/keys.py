"""The name an L1 object has in every L2 tier (its own module: the manager and the prefetcher both use it)."""

from __future__ import annotations

from kvprotocol import ObjectKey

from ..l1 import IKey


def key_str(key: IKey) -> str:
    """The L2 key of an L1 key: `ObjectKey(...).to_str()` (salt hashed, never raw)."""
    return ObjectKey(*key).to_str()
