"""One configured tier: its adapter, counters, last known usage, and health with backoff.

A failing backing store must never slow the server down: after an error the tier is skipped
(lookups miss, writes are dropped and counted) until a backoff expires, then tried again; the
periodic usage probe doubles as the health check, so a store that comes back is picked up without
traffic.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any

from kvprotocol import Backoff

from .base import L2Adapter, L2Error, Usage

log = logging.getLogger("kvserver.l2")
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.25, 2.0


@dataclass
class TierStats:
    puts: int = 0  # objects written
    put_bytes: int = 0  # encoded bytes written
    gets: int = 0  # objects fetched
    get_bytes: int = 0  # encoded bytes fetched
    hits: int = 0  # objects loaded into L1
    misses: int = 0  # objects asked for and absent
    errors: int = 0  # failed operations (each a batch)
    corrupt: int = 0  # failed integrity checks: treated as a miss and deleted
    undecryptable: int = 0  # intact but not openable with this server's key: a miss, kept
    dropped: int = 0  # writes not done (queue full, or tier down with its retry set full)
    retried: int = 0  # writes missed while the tier was down, queued again once it answered
    evicted: int = 0  # objects deleted to keep L2 within --l2-capacity-gb (tiering.py)


class Tier:
    def __init__(self, adapter: L2Adapter) -> None:
        self.adapter = adapter
        self.stats = TierStats()
        self.usage: Usage | None = None
        self.health = Backoff(BACKOFF_MIN_S, BACKOFF_MAX_S)
        self.last_error = ""
        self.retry: OrderedDict[Any, None] = OrderedDict()  # L1 keys to write once the tier answers

    @property
    def url(self) -> str:
        return self.adapter.url

    def available(self) -> bool:
        return self.health.allow()

    @property
    def up(self) -> bool:
        return self.health.up

    def failed(self, exc: L2Error) -> None:
        self.stats.errors += 1
        self.last_error = str(exc)[:200]
        if self.health.up:
            log.warning("L2 tier %s failed, skipping it for now: %s", self.url, self.last_error)
        self.health.failed()

    def succeeded(self) -> None:
        if not self.health.up:
            log.warning("L2 tier %s is back", self.url)
        self.health.succeeded()

    def describe(self) -> dict[str, Any]:
        return {
            "tier": self.url.split("://")[0].replace("+", "-"),  # fs, redis, redis-cluster, s3
            "url": self.url,
            "up": self.up,
            "objects": self.usage.objects if self.usage else None,
            "bytes": self.usage.bytes if self.usage else None,
            "retry_pending": len(self.retry),
            **asdict(self.stats),
            **self.adapter.describe(),
        }
