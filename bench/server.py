"""kvserver core benchmark: ping and lookup latency, shm/tcp store/retrieve throughput.

Starts a real kvserver process, then prints each figure next to a baseline measured in the same
run: a raw pyzmq ROUTER/DEALER echo round trip (in its own process, like the server) for ping, a
single-thread numpy.copyto of the same bytes for transfers. The store->commit and
lookup->retrieve->release sequences are kvprotocol's own (kvprotocol.flows), as an engine runs them.
Run: `uv run python -m bench.server` (`--runs 5` prints medians of 5 runs).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvprotocol import Client, KeySpace, LayoutDescriptor, flows, pack_tokens
from kvprotocol import requests as rq
from kvprotocol.kvsum import kvsum64

from kvconnector import copy as kvcopy
from kvtestkit.ports import free_port

THREADS = 1  # the engine's copy kernel on one thread: the same work as the single-thread memcpy baseline

CHUNK = 256


KVSERVER = str(Path(sys.executable).parent / "kvserver")  # --kvserver: another build (a before/after comparison)


def start_server(
    l1_gb: float, *, command: list[str] | None = None, http_port: int = 0
) -> tuple[subprocess.Popen[bytes], str]:
    """A real kvserver on a free loopback port; `command` replaces the executable (e.g. under cProfile)."""
    port = free_port()
    proc = subprocess.Popen(
        [
            *(command or [KVSERVER]),
            "start",
            "--port",
            str(port),
            "--l1-size-gb",
            str(l1_gb),
            "--http-port",
            str(http_port),
            "--log-level",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
    )
    url = f"tcp://127.0.0.1:{port}"
    with Client(url, timeout=0.5) as c:
        for _ in range(200):
            try:
                c.ping()
                return proc, url
            except Exception:
                time.sleep(0.1)
    proc.kill()
    raise RuntimeError("kvserver did not start")


def pct(values: list[float], p: float) -> float:
    return float(np.percentile(np.array(values), p))


ECHO = """
import sys, zmq
sock = zmq.Context().socket(zmq.ROUTER)
port = sock.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
while True:
    sock.send_multipart(sock.recv_multipart(copy=False), copy=False)
"""


def bench_ping(url: str, iters: int) -> dict[str, float]:
    """ping through the kvserver next to a raw pyzmq ROUTER/DEALER echo (another process) of the same bytes."""
    import zmq

    echo = subprocess.Popen([sys.executable, "-c", ECHO], stdout=subprocess.PIPE)
    try:
        assert echo.stdout is not None
        port = int(echo.stdout.readline())
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{port}")
        frame = b"\x00" * 48  # about a ping request's size
        raw = []
        for _ in range(iters):
            t0 = time.perf_counter()
            sock.send(frame)
            sock.recv()
            raw.append(time.perf_counter() - t0)
        sock.close(linger=0)
    finally:
        echo.terminate()
        echo.wait()
    lat = []
    with Client(url, timeout=5) as c:
        for _ in range(iters):
            t0 = time.perf_counter()
            c.ping()
            lat.append(time.perf_counter() - t0)
    return {
        "raw_p50_ms": pct(raw, 50) * 1e3,
        "p50_ms": pct(lat, 50) * 1e3,
        "p99_ms": pct(lat, 99) * 1e3,
        "ratio": pct(lat, 50) / pct(raw, 50),
    }


def bench_lookup(c: Client, ks: KeySpace, layout: LayoutDescriptor, n_tokens: int, iters: int) -> dict[str, float]:
    tokens = np.arange(n_tokens, dtype=np.uint32) + 7 * n_tokens
    packed = pack_tokens(tokens)
    # make every chunk present (tcp store of zero bytes) so the lookup walks the whole prefix
    zero = bytes(layout.object_bytes)
    flows.store_and_commit(
        c.send,
        rq.Store(keyspace=ks.wire(), tokens=packed, rank=0, mode="tcp"),
        lambda _r, slots: ([zero] * len(slots), [kvsum64(zero)] * len(slots)),
    )
    lat, wire = [], ks.wire()  # built once, as an engine does (kvconnector's EngineLink.keyspace_wire)
    for _ in range(iters):
        t0 = time.perf_counter()
        hit = c.lookup(keyspace=wire, tokens=pack_tokens(tokens)).hit_tokens
        lat.append(time.perf_counter() - t0)
    assert hit == n_tokens // CHUNK * CHUNK
    return {"tokens": n_tokens, "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3}


def bench_transfer(
    c: Client, ks: KeySpace, layout: LayoutDescriptor, arena: np.ndarray | None, mode: str, chunks: int, iters: int
) -> dict[str, float]:
    size = layout.object_bytes
    src = np.random.default_rng(0).integers(0, 255, size * chunks, dtype=np.uint8)
    dst = np.zeros_like(src)
    src_addr, dst_addr = kvcopy.address_of(src), kvcopy.address_of(dst, writable=True)
    arena_addr = kvcopy.address_of(arena, writable=True) if arena is not None else 0
    store_t, retrieve_t, copy_t = [], [], []
    for it in range(iters):
        tokens = pack_tokens(np.arange(chunks * CHUNK, dtype=np.uint32) + it * 10_000_000)
        # baseline: the same bytes through one single-threaded memcpy
        t0 = time.perf_counter()
        np.copyto(dst, src)
        copy_t.append(time.perf_counter() - t0)

        def fill(_reply: object, slots: list) -> tuple[list, list[int]]:
            if mode == "tcp":
                frames = [src[s.chunk * size : (s.chunk + 1) * size] for s in slots]
                return frames, [kvcopy.checksum_bytes(f) for f in frames]
            # shm: what an engine's gather does, one fused copy + kvsum64 pass into the arena slots
            segs = np.array([(s.chunk * size, s.offset, size) for s in slots], dtype=np.int64)
            objs = np.array([(s.offset, size) for s in slots], dtype=np.int64)
            return [], kvcopy.copy_checksum(src_addr, arena_addr, segs, objs, "dst", THREADS)

        def copy(reply: Any, frames: list[memoryview]) -> None:
            if mode == "tcp":
                for obj, frame in zip(reply.objects, frames, strict=True):
                    out = dst[obj.chunk * size : (obj.chunk + 1) * size]
                    np.copyto(out, np.frombuffer(frame, dtype=np.uint8))
                    assert kvcopy.checksum_bytes(out) == obj.checksum
                return
            # shm: an engine's scatter, verifying every object's checksum as it copies
            segs = np.array([(o.offset, o.chunk * size, size) for o in reply.objects], dtype=np.int64)
            objs = np.array([(o.offset, size) for o in reply.objects], dtype=np.int64)
            sums = kvcopy.copy_checksum(arena_addr, dst_addr, segs, objs, "src", THREADS)
            assert sums == [o.checksum for o in reply.objects]

        send = lambda req, frames: c.send(req, frames, timeout=60)  # noqa: E731
        t0 = time.perf_counter()
        flows.store_and_commit(send, rq.Store(keyspace=ks.wire(), tokens=tokens, rank=0, mode=mode), fill)
        store_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        session = Client.new_session()
        c.lookup(keyspace=ks.wire(), tokens=tokens, session=session, rank=0)
        flows.read_leased(
            send,
            rq.Retrieve(session=session, rank=0, start_chunk=0, end_chunk=chunks, mode=mode),
            copy,
            prove=mode == "shm",
        )
        retrieve_t.append(time.perf_counter() - t0)
        assert np.array_equal(dst, src)
        c.clear()
    nbytes = size * chunks
    gbps = lambda ts: nbytes / statistics.median(ts) / 1e9  # noqa: E731
    base = gbps(copy_t)
    return {
        "mode": mode,
        "bytes": nbytes,
        "memcpy_gbps": base,
        "store_gbps": gbps(store_t),
        "retrieve_gbps": gbps(retrieve_t),
        "store_ratio": gbps(store_t) / base,
        "retrieve_ratio": gbps(retrieve_t) / base,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--runs", type=int, default=1, help="runs (a fresh server each); figures are their medians")
    ap.add_argument("--ping-iters", type=int, default=3000)
    ap.add_argument("--kvserver", default=KVSERVER, help="the kvserver executable to measure")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--lookup-iters", type=int, default=2000)
    ap.add_argument("--chunks", type=int, default=16, help="chunks per transfer (16 = a 4k-token prompt)")
    args = ap.parse_args()
    globals()["KVSERVER"] = args.kvserver
    runs = [one_run(args) for _ in range(args.runs)]
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    results: dict[str, object] = {
        "runs": args.runs,
        "ping": {k: med([r["ping"] for r in runs], k) for k in runs[0]["ping"]},
        "lookup": [
            {k: med([r["lookup"][i] for r in runs], k) for k in runs[0]["lookup"][i]}
            for i in range(len(runs[0]["lookup"]))
        ],
        "transfer": [
            {
                k: (runs[0]["transfer"][i][k] if k == "mode" else med([r["transfer"][i] for r in runs], k))
                for k in runs[0]["transfer"][i]
            }
            for i in range(len(runs[0]["transfer"]))
        ],
    }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    p = results["ping"]
    print(f"medians of {args.runs} run(s)")
    print(
        f"ping: p50 {p['p50_ms']:.3f} ms  p99 {p['p99_ms']:.3f} ms | raw pyzmq ROUTER/DEALER p50 "  # type: ignore[index]
        f"{p['raw_p50_ms']:.3f} ms ({p['ratio']:.2f}x)"
    )  # type: ignore[index]
    for i, row in enumerate(results["lookup"]):  # type: ignore[arg-type]
        each = sorted(r["lookup"][i]["p50_ms"] for r in runs)  # the spread between fresh servers
        print(
            f"lookup {row['tokens']:>6.0f} tokens: p50 {row['p50_ms']:.3f} ms  p99 {row['p99_ms']:.3f} ms"
            f"  (p50 of each run: {', '.join(f'{v:.3f}' for v in each)})"
        )
    for row in results["transfer"]:  # type: ignore[union-attr]
        print(
            f"{row['mode']}: {row['bytes'] / 2**20:.0f} MiB  memcpy baseline {row['memcpy_gbps']:.2f} GB/s | "
            f"store {row['store_gbps']:.2f} GB/s ({row['store_ratio']:.0%}) | "
            f"retrieve {row['retrieve_gbps']:.2f} GB/s ({row['retrieve_ratio']:.0%})"
        )


def one_run(args: argparse.Namespace) -> dict[str, Any]:
    """One fresh server: ping, lookups, transfers."""
    # 8 MiB objects: 32 layers x 8 blocks x 32 KiB (a 7B-class fp16 model, 256-token chunk)
    layout = LayoutDescriptor("vllm_cpu", "float16", 32, 32, 32 << 10, CHUNK, (8, 32, 64))
    proc, url = start_server(l1_gb=4.0)
    results: dict[str, Any] = {}
    try:
        results["ping"] = bench_ping(url, args.ping_iters)
        with Client(url, timeout=30) as c:
            reg = c.register_engine(model="bench", world_size=1, rank=0, groups=[rq.LayoutW(**layout.to_wire())])
            ks = KeySpace.from_layouts("bench", 1, [layout])
            fd = os.open(f"/dev/shm/{reg.arena.name}", os.O_RDWR)
            mm = mmap.mmap(fd, reg.arena.size)
            os.close(fd)
            arena = np.frombuffer(mm, dtype=np.uint8)
            small = LayoutDescriptor("vllm_cpu", "float16", 2, 32, 1024, CHUNK, (512,))
            c.register_engine(model="bench", world_size=1, rank=0, groups=[rq.LayoutW(**small.to_wire())])
            ks_small = KeySpace.from_layouts("bench", 1, [small])
            results["lookup"] = [bench_lookup(c, ks_small, small, n, args.lookup_iters) for n in (4096, 32768)]
            results["transfer"] = [
                bench_transfer(c, ks, layout, arena, m, args.chunks, args.iters) for m in ("shm", "tcp")
            ]
            del arena
            mm.close()
    finally:
        proc.terminate()
        proc.wait()
    return results


if __name__ == "__main__":
    main()
