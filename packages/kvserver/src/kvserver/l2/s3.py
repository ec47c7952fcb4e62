"""`s3://bucket/prefix` tier: S3-compatible object storage through boto3 on a private thread pool.

boto3 is the standard, well-kept S3 client; its calls block, so they run on this adapter's own
threads (never the loop's default executor, which the serde work uses). S3 has no batched HEAD, so
`contains` issues the HEADs of a batch concurrently. Endpoint, region and credentials come from the
URL query (`endpoint=`, `region=`) or boto3's usual environment and config files.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from .base import L2Adapter, L2Error, Usage

T = TypeVar("T")
_ABSENT = {"404", "NoSuchKey", "NotFound"}


class S3Adapter(L2Adapter):
    def __init__(
        self,
        bucket: str,
        prefix: str,
        *,
        url: str,
        endpoint: str | None = None,
        region: str | None = None,
        timeout: float = 5.0,
        threads: int = 16,
    ) -> None:
        self.url = url
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="l2-s3")
        config = Config(
            connect_timeout=timeout, read_timeout=timeout, retries={"max_attempts": 2}, max_pool_connections=threads
        )
        self._s3 = boto3.session.Session().client("s3", endpoint_url=endpoint, region_name=region, config=config)

    def _key(self, key: str) -> str:
        return self.prefix + key

    async def _run(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, fn, *args)
        except Exception as exc:
            raise L2Error(f"s3 {what}: {type(exc).__name__}: {exc}"[:300]) from exc

    async def put(self, items: Sequence[tuple[str, bytes]]) -> None:
        await asyncio.gather(*(self._run("put", self._put_one, k, v) for k, v in items))

    def _put_one(self, key: str, blob: bytes) -> None:
        self._s3.put_object(Bucket=self.bucket, Key=self._key(key), Body=blob)

    async def get(self, keys: Sequence[str]) -> list[bytes | None]:
        return list(await asyncio.gather(*(self._run("get", self._get_one, k) for k in keys)))

    def _get_one(self, key: str) -> bytes | None:
        try:
            return self._s3.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in _ABSENT:
                return None
            raise

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        return list(await asyncio.gather(*(self._run("contains", self._head_one, k) for k in keys)))

    def _head_one(self, key: str) -> bool:
        try:
            self._s3.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in _ABSENT:
                return False
            raise

    async def delete(self, keys: Sequence[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[i : i + 1000]]
            await self._run(
                "delete",
                lambda b=batch: self._s3.delete_objects(Bucket=self.bucket, Delete={"Objects": b, "Quiet": True}),
            )

    async def usage(self) -> Usage:
        """Objects and bytes under the prefix, by listing (capped at 100k objects per refresh)."""
        return await self._run("usage", self._usage)

    def _usage(self) -> Usage:
        objects = size = 0
        for page in self._s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix, PaginationConfig={"MaxItems": 100_000}
        ):
            for item in page.get("Contents", []):
                objects += 1
                size += int(item["Size"])
        return Usage(objects, size)

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._s3.close()
