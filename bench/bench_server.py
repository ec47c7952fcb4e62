"""kvserver core benchmark: lookup latency and shm/tcp store/retrieve throughput.

Starts a real kvserver process, then prints each figure next to a baseline measured in the same
run (a single-thread numpy.copyto of the same bytes). Run: `uv run python bench/bench_server.py`.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvprotocol.kvsum import kvsum64
from kvprotocol import Client, KeySpace, LayoutDescriptor, pack_tokens

CHUNK = 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(l1_gb: float) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    exe = Path(sys.executable).parent / "kvserver"
    proc = subprocess.Popen([str(exe), "start", "--port", str(port), "--l1-size-gb", str(l1_gb), "--http-port", "0",
                             "--log-level", "warning"], stdout=subprocess.DEVNULL)
    url = f"tcp://127.0.0.1:{port}"
    with Client(url, timeout=0.5) as c:
        for _ in range(100):
            try:
                c.call("ping")
                return proc, url
            except Exception:
                time.sleep(0.1)
    raise RuntimeError("kvserver did not start")


def pct(values: list[float], p: float) -> float:
    return float(np.percentile(np.array(values), p))


def bench_lookup(c: Client, ks: KeySpace, layout: LayoutDescriptor, n_tokens: int, iters: int) -> dict[str, float]:
    tokens = np.arange(n_tokens, dtype=np.uint32) + 7 * n_tokens
    packed = pack_tokens(tokens)
    # make every chunk present (tcp store of zero bytes) so the lookup walks the whole prefix
    reply = c.call("store", keyspace=ks.to_wire(), tokens=packed, rank=0, mode="tcp").result
    zero = bytes(layout.object_bytes)
    n_reserved = sum(s["status"] == "reserved" for s in reply["slots"])
    if reply["store_id"]:
        c.call("commit", frames=[zero] * n_reserved, store_id=reply["store_id"], checksums=[kvsum64(zero)] * n_reserved)
    lat = []
    for _ in range(iters):
        t0 = time.perf_counter()
        hit = c.call("lookup", keyspace=ks.to_wire(), tokens=pack_tokens(tokens)).result["hit_tokens"]
        lat.append(time.perf_counter() - t0)
    assert hit == n_tokens // CHUNK * CHUNK
    return {"tokens": n_tokens, "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3}


def bench_transfer(c: Client, ks: KeySpace, layout: LayoutDescriptor, arena: np.ndarray | None, mode: str,
                   chunks: int, iters: int) -> dict[str, float]:
    size = layout.object_bytes
    src = np.random.default_rng(0).integers(0, 255, size * chunks, dtype=np.uint8)
    dst = np.empty_like(src)
    store_t, retrieve_t, copy_t = [], [], []
    for it in range(iters):
        tokens = pack_tokens(np.arange(chunks * CHUNK, dtype=np.uint32) + it * 10_000_000)
        # baseline: the same bytes through one single-threaded memcpy
        t0 = time.perf_counter()
        np.copyto(dst, src)
        copy_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        reply = c.call("store", keyspace=ks.to_wire(), tokens=tokens, rank=0, mode=mode).result
        frames, checksums = [], []
        for i, slot in enumerate(reply["slots"]):
            part = src[i * size : (i + 1) * size]
            checksums.append(kvsum64(part))
            if mode == "shm":
                np.copyto(arena[slot["offset"] : slot["offset"] + size], part)
            else:
                frames.append(part)
        c.call("commit", frames=frames, store_id=reply["store_id"], checksums=checksums, timeout=60)
        store_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        c.call("lookup", keyspace=ks.to_wire(), tokens=tokens, session="bench")
        got = c.call("retrieve", session="bench", rank=0, start_chunk=0, end_chunk=chunks, mode=mode, timeout=60)
        for i, obj in enumerate(got.result["objects"]):
            out = dst[i * size : (i + 1) * size]
            if mode == "shm":
                np.copyto(out, arena[obj["offset"] : obj["offset"] + size])
            else:
                np.copyto(out, np.frombuffer(got.frames[i], dtype=np.uint8))
        c.call("end_session", session="bench")
        retrieve_t.append(time.perf_counter() - t0)
        assert np.array_equal(dst, src)
        c.call("clear")
    nbytes = size * chunks
    gbps = lambda ts: nbytes / statistics.median(ts) / 1e9  # noqa: E731
    base = gbps(copy_t)
    return {"mode": mode, "bytes": nbytes, "memcpy_gbps": base, "store_gbps": gbps(store_t),
            "retrieve_gbps": gbps(retrieve_t), "store_ratio": gbps(store_t) / base,
            "retrieve_ratio": gbps(retrieve_t) / base}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--lookup-iters", type=int, default=2000)
    ap.add_argument("--chunks", type=int, default=16, help="chunks per transfer (16 = a 4k-token prompt)")
    args = ap.parse_args()
    # 8 MiB objects: 32 layers x 8 blocks x 32 KiB (a 7B-class fp16 model, 256-token chunk)
    layout = LayoutDescriptor("vllm_cpu", "float16", 32, 32, 32 << 10, CHUNK, (8, 32, 64))
    proc, url = start_server(l1_gb=4.0)
    results: dict[str, object] = {}
    try:
        with Client(url, timeout=30) as c:
            reg = c.call("register_engine", model="bench", world_size=1, rank=0, groups=[layout.to_wire()]).result
            ks = KeySpace.from_layouts("bench", 1, [layout])
            fd = os.open(f"/dev/shm/{reg['arena']['name']}", os.O_RDWR)
            mm = mmap.mmap(fd, reg["arena"]["size"])
            os.close(fd)
            arena = np.frombuffer(mm, dtype=np.uint8)
            small = LayoutDescriptor("vllm_cpu", "float16", 2, 32, 1024, CHUNK, (512,))
            c.call("register_engine", model="bench", world_size=1, rank=0, groups=[small.to_wire()])
            ks_small = KeySpace.from_layouts("bench", 1, [small])
            results["lookup"] = [bench_lookup(c, ks_small, small, n, args.lookup_iters) for n in (4096, 32768)]
            results["transfer"] = [bench_transfer(c, ks, layout, arena, m, args.chunks, args.iters)
                                   for m in ("shm", "tcp")]
            del arena
            mm.close()
    finally:
        proc.terminate()
        proc.wait()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for row in results["lookup"]:  # type: ignore[union-attr]
        print(f"lookup {row['tokens']:>6} tokens: p50 {row['p50_ms']:.3f} ms  p99 {row['p99_ms']:.3f} ms")
    for row in results["transfer"]:  # type: ignore[union-attr]
        print(f"{row['mode']}: {row['bytes'] / 2**20:.0f} MiB  memcpy baseline {row['memcpy_gbps']:.2f} GB/s | "
              f"store {row['store_gbps']:.2f} GB/s ({row['store_ratio']:.0%}) | "
              f"retrieve {row['retrieve_gbps']:.2f} GB/s ({row['retrieve_ratio']:.0%})")


if __name__ == "__main__":
    main()
