"""The name an L1 object has in every L2 tier (its own module: the manager and the prefetcher both use it)."""

from __future__ import annotations

from kvprotocol import ObjectKey


def key_str(key: ObjectKey) -> str:
    """The L2 key of an L1 key: `key.to_str()` (salt hashed, never raw)."""
    return key.to_str()
