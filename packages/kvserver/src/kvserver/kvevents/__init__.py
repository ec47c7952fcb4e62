"""KV events for KV-aware routers (llm-d, Dynamo): our tiers' stores and removals in vLLM's format.

See docs/kv-events.md. `wire` is the format, `publisher` the sockets, `tracker` the mapping from
cache objects to blocks; `KVEvents` wires them to one server's L1 and cache service.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from .publisher import PLAIN_USER, ZmqEventPublisher
from .l2tracker import L2EventTracker, tier_media
from .tracker import EventBatcher, L1EventTracker
from .wire import END_SEQ, HASH_FORMATS, MEDIUM_L1, decode_batch, encode_batch

log = logging.getLogger("kvserver.kvevents")

if TYPE_CHECKING:
    from ..service.cache import CacheService
    from ..config import ServerConfig
    from ..l1.cache import L1Cache
    from ..l2 import TierManager

__all__ = [
    "END_SEQ",
    "HASH_FORMATS",
    "MEDIUM_L1",
    "PLAIN_USER",
    "EventBatcher",
    "EventsSnapshot",
    "KVEvents",
    "L1EventTracker",
    "L2EventTracker",
    "ZmqEventPublisher",
    "decode_batch",
    "encode_batch",
]


class EventsSnapshot(NamedTuple):
    """The L1 blocks announced and not removed, and the sequence number the stream goes on from."""

    next_seq: int
    medium: str
    models: dict[str, list[bytes]]  # model -> chunk hashes


def events_password(config: ServerConfig, token: str) -> str | None:
    """The PLAIN password of both event sockets: the server's token, on loopback and ipc:// too (the
    stream carries every tenant's token ids); None (open) only with --insecure and no configured token,
    the operator's explicit choice for routers that cannot send credentials."""
    return None if config.insecure and not config.api_token else token


class KVEvents:
    """The publisher, batcher and L1 tracker of one server, hooked into its cache."""

    def __init__(
        self,
        config: ServerConfig,
        l1: L1Cache,
        cache: CacheService,
        l2: TierManager | None = None,
        *,
        token: str,
    ) -> None:
        assert config.kv_events_endpoint
        self.publisher = ZmqEventPublisher(
            config.kv_events_endpoint,
            config.kv_events_replay_endpoint,
            buffer_batches=config.kv_events_buffer,
            password=events_password(config, token),
            replay_max_bytes=config.kv_events_replay_max_bytes,
            replay_rate=config.kv_events_replay_rate,
        )
        self.batcher = EventBatcher(self.publisher.publish, config.kv_events_topic, config.kv_events_hash_format)
        self.l1 = L1EventTracker(l1, self.batcher, config.chunk_size)
        self.failures = 0  # hook calls that raised (logged; the cache op goes on)
        cache.on_commit_txn.append(self._guard(self.l1.committed))
        cache.on_prefetched.append(self._guard(self.l1.prefetched))
        l1.on_evict.append(self._guard(self.l1.removed))
        l1.on_clear.append(self._guard(self.l1.removed))
        self.l2: L2EventTracker | None = None
        if l2 is not None:
            media = tier_media([t.describe()["tier"] for t in l2.tiers])
            self.l2 = L2EventTracker(self.l1, self.batcher, media, config.chunk_size)
            l2.on_put.append(self._guard(self.l2.put))
            l2.on_missing.append(self._guard(self.l2.missing))

    def _guard(self, hook: Callable[..., None]) -> Callable[..., None]:
        """Events are a side channel: a failing hook must never fail the commit or eviction it observes."""

        def guarded(*args: Any) -> None:
            try:
                hook(*args)
            except Exception:
                self.failures += 1
                if self.failures <= 10 or self.failures % 1000 == 0:
                    log.exception("KV events hook %s failed (%d so far)", hook.__name__, self.failures)

        return guarded

    def start(self) -> None:
        self.publisher.start()
        self.l1.started()

    async def stop(self) -> None:
        self.batcher.flush()
        await self.publisher.stop()

    def close(self) -> None:
        self.publisher.close()

    def snapshot(self) -> EventsSnapshot:
        """Taken after pending events are flushed, so it is the state after every batch below next_seq."""
        self.batcher.flush()  # what is pending gets its seq now, so it lies below next_seq
        return EventsSnapshot(self.publisher.next_seq, self.l1.medium, self.l1.snapshot())

    def describe(self) -> dict[str, Any]:
        return {
            **self.publisher.describe(),
            "l1_blocks": self.l1.blocks,
            "hook_failures": self.failures,
            **({"l2_blocks": self.l2.blocks()} if self.l2 is not None else {}),
        }
