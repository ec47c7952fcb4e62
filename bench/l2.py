"""L2 tier benchmark: put/get throughput per adapter and per serde option, against raw baselines.

For each backing store it measures, in the same run, the raw operation on the same bytes (a plain
file write/read; plain redis SET/GET in the same pipelined batches; plain S3 put/get) and then the
L2 adapter with each serde chain (integrity header always; lz4/zstd; AES-GCM), and prints the ratio
to the baseline (rounds alternate the order of the sides; medians of the per-round ratios). Backing
stores are real processes started here: a redis-server, a 3-node Redis Cluster (redis-server +
redis-cli), a moto S3 server; missing binaries skip that store.

First, the fs tier on its direct path (writev from the object's buffer, preadv into the
destination, the header checked in place; beside it with the body hashed too, and with `direct=1`)
against a plain write / readinto of the same bytes with the same batching, threads and fsync policy,
on tmpfs, a warm file system and the disk with the page cache dropped (bench/l2_fs.py: alternating
rounds, medians and ranges). Then the serde chains per store: writes as the server makes them
(`put_parts`, header and body unjoined, where the adapter takes parts: fs and a single Redis node),
reads whole (`get`, then `Serde.decode`; the fs rows read from the page cache).

Objects look like KV cache: float16 values from a normal distribution (compresses a little; pass
`--data zeros` or `--data random` for the extremes).

Run: `uv run python -m bench.l2 [--json] [--objects 64] [--object-kib 1024] [--rounds 9] [--fs-only]`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
from kvserver.l2 import L2Adapter, Serde, make_adapter
from rich.console import Console
from rich.progress import Progress
from kvtestkit.ports import free_port

from bench import l2_fs

BATCH = 16  # objects per put/get call, as the write-behind writers batch
AES = bytes(range(32))
JOINED = "whole blobs"  # writes of whole blobs, where the adapter would take the parts
CHAINS = {
    "integrity": Serde(),
    "lz4": Serde("lz4"),
    "zstd": Serde("zstd"),
    "aes-gcm": Serde("none", AES),
    "zstd+aes-gcm": Serde("zstd", AES),
}
console = Console(stderr=True)


def make_objects(kind: str, n: int, size: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    if kind == "zeros":
        return [bytes(size) for _ in range(n)]
    if kind == "random":
        return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]
    return [rng.normal(0, 1, size // 2).astype(np.float16).tobytes() for _ in range(n)]


def keys_for(n: int, tag: str) -> list[str]:
    return [f"kv1/bench/0123456789abcdef/w1r0/g0/-/{tag}-{i:08d}" for i in range(n)]


async def timed(fn: Callable[[], Awaitable[Any]]) -> float:
    t0 = time.perf_counter()
    await fn()
    return time.perf_counter() - t0


# -- backing stores ------------------------------------------------------------------------------
class Procs:
    """Processes started by this benchmark, all stopped at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-l2-"))

    def redis(self, *extra: str) -> int:
        port = free_port()
        self.procs.append(
            subprocess.Popen(
                [
                    "redis-server",
                    "--port",
                    str(port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.tmp),
                    *extra,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        wait_port(port)
        return port

    def cluster(self) -> int:
        ports = [
            self.redis(
                "--cluster-enabled",
                "yes",
                "--cluster-port",
                str(free_port()),
                "--cluster-config-file",
                str(self.tmp / f"nodes-{i}.conf"),
            )
            for i in range(3)
        ]
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *[f"127.0.0.1:{p}" for p in ports],
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        for _ in range(300):
            out = subprocess.run(
                ["redis-cli", "-p", str(ports[0]), "cluster", "info"], capture_output=True, text=True
            ).stdout
            if "cluster_state:ok" in out:
                break
            time.sleep(0.1)
        return ports[0]

    def moto(self) -> str:
        port = free_port()
        exe = Path(sys.executable).parent / "moto_server"
        log = open(self.tmp / "moto.log", "wb")
        self.procs.append(
            subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
        )
        wait_port(port)
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(10)
        if os.environ.get("BENCH_KEEP_TMP"):
            console.print(f"kept {self.tmp}")
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)


def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port}")


# -- baselines -----------------------------------------------------------------------------------
def raw_file(root: Path, objs: list[bytes]) -> tuple[float, float]:
    root.mkdir(parents=True, exist_ok=True)
    paths = [root / f"raw-{i}" for i in range(len(objs))]
    t0 = time.perf_counter()
    for p, b in zip(paths, objs, strict=True):
        p.write_bytes(b)
    t1 = time.perf_counter()
    for p in paths:
        p.read_bytes()
    return t1 - t0, time.perf_counter() - t1


async def raw_redis(url: str, cluster: bool, objs: list[bytes]) -> tuple[float, float]:
    import redis.asyncio as aredis
    from redis.asyncio.cluster import RedisCluster

    r: Any = RedisCluster.from_url(url) if cluster else aredis.Redis.from_url(url)
    keys = keys_for(len(objs), "raw")

    def pipeline() -> Any:  # no MULTI/EXEC around a batch: what the adapter sends, and a user would
        return r.pipeline() if cluster else r.pipeline(transaction=False)

    async def put() -> None:
        for i in range(0, len(objs), BATCH):
            pipe = pipeline()
            for k, b in zip(keys[i : i + BATCH], objs[i : i + BATCH], strict=True):
                pipe.set(k, b)
            await pipe.execute()

    async def get() -> None:
        for i in range(0, len(objs), BATCH):
            pipe = pipeline()
            for k in keys[i : i + BATCH]:
                pipe.get(k)
            await pipe.execute()

    out = await timed(put), await timed(get)
    await r.aclose()
    return out


def raw_s3(endpoint: str, bucket: str, objs: list[bytes]) -> tuple[float, float]:
    from concurrent.futures import ThreadPoolExecutor

    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    keys = keys_for(len(objs), "raw")
    with ThreadPoolExecutor(BATCH) as pool:  # the adapter also runs one batch's requests at once
        t0 = time.perf_counter()
        list(pool.map(lambda kb: s3.put_object(Bucket=bucket, Key=kb[0], Body=kb[1]), zip(keys, objs)))
        t1 = time.perf_counter()
        list(pool.map(lambda k: s3.get_object(Bucket=bucket, Key=k)["Body"].read(), keys))
        return t1 - t0, time.perf_counter() - t1


# -- the adapter with a serde chain -------------------------------------------------------------
async def adapter_run(
    adapter: L2Adapter, serde: Serde, objs: list[bytes], tag: str, joined: bool = False
) -> dict[str, float]:
    """`joined`: write whole blobs (`put`) even where the adapter takes parts, as servers did before."""
    keys = keys_for(len(objs), tag)
    stored = 0

    async def put() -> None:
        nonlocal stored
        for i in range(0, len(objs), BATCH):
            batch = zip(keys[i : i + BATCH], objs[i : i + BATCH], strict=True)
            if adapter.takes_parts and not joined:  # as the server writes to it: header and body, never joined
                parts = [(k, serde.encode_parts(k, b, 0)) for k, b in batch]
                stored += sum(len(h) + len(body) for _, (h, body) in parts)
                await adapter.put_parts(parts)
            else:
                blobs = [(k, serde.encode(k, b, 0)) for k, b in batch]
                stored += sum(len(b) for _, b in blobs)
                await adapter.put(blobs)

    async def get() -> None:
        for i in range(0, len(objs), BATCH):
            batch = keys[i : i + BATCH]
            for k, blob in zip(batch, await adapter.get(batch), strict=True):
                assert blob is not None
                serde.decode(k, blob)

    put_s, get_s = await timed(put), await timed(get)
    return {"put_s": put_s, "get_s": get_s, "stored_ratio": stored / sum(len(o) for o in objs)}


async def bench_store(
    name: str,
    url: str,
    objs: list[bytes],
    chains: dict[str, Serde],
    baseline: Callable[[], Awaitable[tuple[float, float]]],
    progress: Progress,
    repeat: int,
) -> list[dict]:
    """The raw client and every chain, in `repeat` rounds that alternate their order (this machine is
    shared: load drift then hits every side alike); MB/s are medians over rounds, ratios the median of
    the per-round ratios to the raw client."""
    total = sum(len(o) for o in objs)
    adapter = make_adapter(url)
    await adapter.start()

    async def raw() -> dict[str, float]:
        put_s, get_s = await baseline()
        return {"put_s": put_s, "get_s": get_s, "stored_ratio": 1.0}

    sides: dict[str, Callable[[], Awaitable[dict[str, float]]]] = {"raw baseline": raw}
    for chain_name, serde in chains.items():
        sides[chain_name] = functools.partial(adapter_run, adapter, serde, objs, chain_name)
    if adapter.takes_parts and "integrity" in chains:  # what writing the parts buys, in the same rounds
        sides[JOINED] = functools.partial(adapter_run, adapter, chains["integrity"], objs, "joined", True)
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in sides}
    task = progress.add_task(name, total=repeat * len(sides))
    try:
        for r in range(repeat):
            for side in list(sides) if r % 2 == 0 else list(sides)[::-1]:
                runs[side].append(await sides[side]())
                progress.advance(task)
    finally:
        await adapter.close()
    base = runs["raw baseline"]
    rows = []
    for side, got in runs.items():
        rows.append(
            {
                "store": name,
                "chain": side,
                "put_MBps": statistics.median(total / g["put_s"] / 1e6 for g in got),
                "get_MBps": statistics.median(total / g["get_s"] / 1e6 for g in got),
                "put_ratio": statistics.median(b["put_s"] / g["put_s"] for b, g in zip(base, got, strict=True)),
                "get_ratio": statistics.median(b["get_s"] / g["get_s"] for b, g in zip(base, got, strict=True)),
                "stored_ratio": got[0]["stored_ratio"],
            }
        )
    return rows


async def run(args: argparse.Namespace) -> dict[str, Any]:
    objs = make_objects(args.data, args.objects, args.object_kib << 10)
    fs_direct = await l2_fs.run(objs, args.rounds, args.fs_media.split(","))
    procs = Procs()
    rows: list[dict] = []
    skipped: list[str] = []
    if args.fs_only:
        return {"objects": args.objects, "object_bytes": args.object_kib << 10, "fs_direct": fs_direct, "rows": []}
    try:
        with Progress(console=console, transient=True) as progress:
            fs_root = procs.tmp / "fs"
            rows += await bench_store(
                "fs",
                f"fs://{fs_root}/l2",
                objs,
                CHAINS,
                lambda: asyncio.to_thread(raw_file, fs_root / "raw", objs),
                progress,
                args.repeat,
            )
            if shutil.which("redis-server"):
                url = f"redis://127.0.0.1:{procs.redis()}/0"
                rows += await bench_store(
                    "redis", url, objs, CHAINS, lambda: raw_redis(url, False, objs), progress, args.repeat
                )
                if shutil.which("redis-cli") and not args.quick:
                    seed = procs.cluster()
                    curl = f"redis+cluster://127.0.0.1:{seed}"
                    rows += await bench_store(
                        "redis-cluster",
                        curl,
                        objs,
                        {"integrity": CHAINS["integrity"]},
                        lambda: raw_redis(f"redis://127.0.0.1:{seed}", True, objs),
                        progress,
                        args.repeat,
                    )
            else:
                skipped.append("redis (no redis-server)")
            if (Path(sys.executable).parent / "moto_server").exists() and not args.quick:
                for k, v in {
                    "AWS_ACCESS_KEY_ID": "bench",
                    "AWS_SECRET_ACCESS_KEY": "bench",
                    "AWS_DEFAULT_REGION": "us-east-1",
                }.items():
                    os.environ.setdefault(k, v)
                endpoint = procs.moto()
                import boto3

                boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="bench")
                few = objs[: max(BATCH, len(objs) // 4)]  # moto is slow; fewer objects
                rows += await bench_store(
                    "s3 (moto)",
                    f"s3://bench/l2?endpoint={endpoint}&region=us-east-1",
                    few,
                    {"integrity": CHAINS["integrity"]},
                    lambda: asyncio.to_thread(raw_s3, endpoint, "bench", few),
                    progress,
                    args.repeat,
                )
            else:
                skipped.append("s3 (moto_server missing or --quick)")
    finally:
        procs.stop()
    return {
        "objects": args.objects,
        "repeat": args.repeat,
        "object_bytes": args.object_kib << 10,
        "batch": BATCH,
        "data": args.data,
        "fs_direct": fs_direct,
        "rows": rows,
        "skipped": skipped,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--objects", type=int, default=64, help="objects per measurement")
    ap.add_argument("--object-kib", type=int, default=1024, help="object size in KiB")
    ap.add_argument("--data", choices=["kv", "zeros", "random"], default="kv")
    ap.add_argument("--quick", action="store_true", help="fs and standalone redis only")
    ap.add_argument("--repeat", type=int, default=5, help="alternating rounds per store (medians are kept)")
    ap.add_argument("--rounds", type=int, default=9, help="alternating rounds of the fs direct comparison")
    ap.add_argument("--fs-media", default="tmpfs,warm,disk", help="of tmpfs, warm, disk (comma-separated)")
    ap.add_argument("--fs-only", action="store_true", help="only the fs direct comparison")
    args = ap.parse_args()
    bad = set(args.fs_media.split(",")) - set(l2_fs.MEDIA)
    if bad or args.rounds < 1:
        ap.error(f"--fs-media takes {','.join(l2_fs.MEDIA)} (not {','.join(sorted(bad))}); --rounds >= 1")
    results = asyncio.run(run(args))
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"fs tier vs plain, {args.objects} objects x {args.object_kib} KiB, batches of {l2_fs.BATCH}, "
        f"{args.rounds} alternating rounds: median (min-max)"
    )
    print(l2_fs.table(results["fs_direct"]))
    if args.fs_only:
        return
    print()
    print(
        f"{args.objects} objects x {args.object_kib} KiB ({args.data} data), batches of {BATCH}, "
        f"medians of {args.repeat} alternating rounds"
    )
    print(f"{'store':<14}{'chain':<15}{'put MB/s':>10}{'x raw':>7}{'get MB/s':>10}{'x raw':>7}{'stored':>8}")
    for r in results["rows"]:
        print(
            f"{r['store']:<14}{r['chain']:<15}{r['put_MBps']:>10.0f}{r['put_ratio']:>7.2f}"
            f"{r['get_MBps']:>10.0f}{r['get_ratio']:>7.2f}{r['stored_ratio']:>8.2f}"
        )
    for s in results["skipped"]:
        print(f"skipped: {s}")


if __name__ == "__main__":
    main()
