"""`redis://` and `redis+cluster://` tiers: Redis or Valkey, binary values, pipelined, optional TTL.

Several kvservers pointing at one Redis (or one Redis Cluster) share their caches. Every batch is one
pipeline (the cluster client splits it by slot). Socket timeouts and an overall deadline bound every
call, and the client retries once on a fresh connection (so a restarted Redis is picked up again);
any failure surfaces as `L2Error`.

A single node's writes take parts (`put_parts`): each SET is packed by hand, its value sent as the
blob's header followed by the body straight from its L1 slot, so no joined copy of the object is
made (redis-py would take only one buffer per value). A cluster's writes go through the client's
pipeline, which routes them by slot, with joined blobs.

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

from .base import BlobParts, L2Adapter, L2Error, LazyBlob, Usage, blob_parts

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
        self.takes_parts = not cluster  # a cluster's pipeline routes commands by slot: joined blobs
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

    async def put_parts(self, items: Sequence[tuple[str, BlobParts | LazyBlob]]) -> None:
        if not items:
            return
        if self.cluster:
            await super().put_parts(items)
            return
        parts = await asyncio.to_thread(lambda: [(k, blob_parts(b)) for k, b in items])  # lazy ones encoded here
        packed = _pack_sets(self.prefix, self.ttl, parts)

        async def send() -> None:
            for attempt in (0, 1):  # once more on a fresh connection, as the client's retry does
                try:
                    await self._send_packed(packed, len(parts))
                    return
                except (aredis.ConnectionError, aredis.TimeoutError):
                    if attempt:
                        raise

        await self._call("put", send)

    async def _send_packed(self, packed: list[bytes | memoryview], replies: int) -> None:
        pool = self._r.connection_pool
        conn = await pool.get_connection()
        try:
            await conn.send_packed_command(packed, check_health=False)
            for _ in range(replies):
                await conn.read_response()  # raises the server's error reply (e.g. OOM)
        except BaseException:
            await conn.disconnect()  # never reuse a connection with replies left unread
            raise
        finally:
            await pool.release(conn)

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


def _pack_sets(prefix: str, ttl: int | None, items: list[tuple[str, BlobParts]]) -> list[bytes | memoryview]:
    """RESP of `SET key value [EX ttl]` per item, the value's parts as they are (no joined copy)."""
    out: list[bytes | memoryview] = []
    expiry = b"" if ttl is None else b"$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(ttl)), ttl)
    for key, parts in items:
        name = (prefix + key).encode()
        size = sum(len(p) for p in parts)
        out.append(b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (5 if expiry else 3, len(name), name, size))
        out += [p if isinstance(p, bytes) else memoryview(p).cast("B") for p in parts if len(p)]
        out.append(b"\r\n" + expiry)
    return out


def _glob_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)
