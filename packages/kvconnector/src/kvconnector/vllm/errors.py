"""The connector's refusal of an engine it cannot cache (logged; the engine runs without it)."""

from __future__ import annotations


class UnsupportedLayout(ValueError):
    """This engine's KV cache cannot be cached by KVServerConnector (logged; the engine runs without it)."""
