"""`redis://` and `redis+cluster://` tiers: Redis or Valkey, binary values, pipelined, optional TTL.

Several kvservers pointing at one Redis (or one Redis Cluster) share their caches. Every batch is one
pipeline (the cluster client splits it by slot). Socket timeouts and an overall deadline bound every
call, and the client retries once on a fresh connection (so a restarted Redis is picked up again);
any failure surfaces as `L2Error`.

Keys live under an optional `prefix` (servers that share a cache use the same one), and `usage`
counts only this cache's own keys (a SCAN of `<prefix>kv1/*` with their STRLEN), never the rest of
the database.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import redis.asyncio as aredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from .base import L2Adapter, L2Error, Usage

T = TypeVar("T")


class RedisAdapter(L2Adapter):
    def __init__(
        self,
        client_url: str,
        *,
        url: str,
        cluster: bool = False,
        ttl: int | None = None,
        timeout: float = 2.0,
        prefix: str = "",
    ) -> None:
        self.url = url
        self.prefix = prefix
        self.cluster = cluster
        self.ttl = ttl
        self.timeout = timeout
        common: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "retry": Retry(NoBackoff(), 1),
        }
        if cluster:
            self._r: Any = RedisCluster.from_url(client_url, **common)
        else:
            self._r = aredis.Redis.from_url(client_url, health_check_interval=30, **common)

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        try:
            return await asyncio.wait_for(fn(), timeout=self.timeout * 3)
        except L2Error:
            raise
        except Exception as exc:  # connection refused, timeouts, cluster down, OOM, ...
            raise L2Error(f"redis {what}: {type(exc).__name__}: {exc}"[:300]) from exc

    def _pipeline(self) -> Any:
        return self._r.pipeline(transaction=False) if not self.cluster else self._r.pipeline()

    async def _batch(self, what: str, add: Callable[[Any], object]) -> list[Any]:
        async def run() -> list[Any]:
            pipe = self._pipeline()
            add(pipe)
            return await pipe.execute()

        return await self._call(what, run)

    async def put(self, items: Sequence[tuple[str, bytes]]) -> None:
        if items:
            pre = self.prefix
            await self._batch("put", lambda p: [p.set(pre + k, v, ex=self.ttl) for k, v in items])

    async def get(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        return await self._batch("get", lambda p: [p.get(self.prefix + k) for k in keys])

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        return [bool(n) for n in await self._batch("contains", lambda p: [p.exists(self.prefix + k) for k in keys])]

    async def delete(self, keys: Sequence[str]) -> None:
        if keys:
            await self._batch("delete", lambda p: [p.delete(self.prefix + k) for k in keys])

    async def usage(self) -> Usage:
        """Objects and value bytes of this cache's own keys: SCAN `<prefix>kv1/*`, STRLEN per page.

        Not bounded by the per-call deadline (a big cache takes a while); each page is one round trip.
        """
        pattern = _glob_escape(self.prefix) + "kv1/*"

        async def page(keys: list[Any]) -> int:
            return sum(await self._batch("usage", lambda p: [p.strlen(k) for k in keys]))

        objects = size = 0
        batch: list[Any] = []
        try:
            async for key in self._r.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) >= 1000:
                    objects, size, batch = objects + len(batch), size + await page(batch), []
            if batch:
                objects, size = objects + len(batch), size + await page(batch)
        except L2Error:
            raise
        except Exception as exc:
            raise L2Error(f"redis usage: {type(exc).__name__}: {exc}"[:300]) from exc
        return Usage(objects, size)

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self._r.aclose(), timeout=self.timeout)
        except Exception:  # closing a dead connection may fail; nothing is left to release
            pass


def _glob_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)
