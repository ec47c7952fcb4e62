"""L2 tiers below L1: filesystem, Redis/Valkey (and Redis Cluster), S3; see docs/l2.md."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import L2Adapter, L2Error, Usage
from .keys import key_str
from .manager import TierManager
from .serde import CorruptObject, Serde, UndecryptableObject, load_key
from .urls import make_adapter, redact

if TYPE_CHECKING:
    from ..config import ServerConfig
    from ..l1.cache import L1Cache

__all__ = [
    "CorruptObject",
    "L2Adapter",
    "L2Error",
    "Serde",
    "TierManager",
    "UndecryptableObject",
    "Usage",
    "build_tier_manager",
    "key_str",
    "load_key",
    "make_adapter",
    "redact",
]


def build_tier_manager(config: ServerConfig, l1: L1Cache) -> TierManager | None:
    """The tier manager for `config.l2` (None when no tier is configured); ValueError on bad settings."""
    if not config.l2:
        return None
    serde = Serde(
        config.l2_compression, load_key(config.l2_encryption_key_file), hash_landed=config.l2_verify == "server"
    )
    adapters = [make_adapter(url) for url in config.l2]
    return TierManager(
        adapters,
        serde,
        l1,
        queue_size=config.l2_queue_size,
        prefetch_timeout=config.l2_prefetch_timeout,
        admission=config.l2_admission,
        capacity_bytes=None if config.l2_capacity_gb is None else int(config.l2_capacity_gb * (1 << 30)),
        eviction_policy=config.l2_eviction_policy,
        negative_ttl=config.l2_negative_ttl,
        retry_keys=config.l2_retry_keys,
    )
