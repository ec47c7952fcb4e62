"""Paged KV gather/scatter throughput: C++ kernel vs numpy fallback vs torch, against memcpy; and
the cost of verification: the fused copy + per-object kvsum64 (`copy_checksum`, what every store
and load runs) against the plain copy of the same rows, measured alternately in the same run.

Why: the copy between an engine's paged KV and the cache arena is the data plane of every store and
retrieve; it should run near memory bandwidth. Each method's GB/s is printed next to a single-thread
numpy.copyto of the same number of bytes, measured right before it, and their ratio. The baseline
copies between the same memory (a contiguous slice of the KV cache and the arena), so the ratio
shows the cost of paging alone, not the difference between allocators (numpy asks for huge pages,
torch does not; that alone moves memcpy by ~20% here). The memcpy between two fresh numpy buffers is
printed in each table's title for reference.

    uv run python -m bench.copy_kernels                  # 128- and 32-token blocks, 32 x 8 x 128 fp16
    uv run python -m bench.copy_kernels --json           # machine-readable
    uv run python -m bench.copy_kernels --chunks 4 --repeats 3 --block-sizes 128
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvconnector import _copy_fallback, copy, layouts
from kvconnector.engine_kv import EngineKV, block_rows, object_table, save_moves

try:
    from rich.console import Console
    from rich.table import Table
except ImportError:  # plain output without rich
    Console = None  # type: ignore[assignment,misc]


def _time(fn: Callable[[], Any], repeats: int) -> float:
    """Best seconds of `repeats` calls after one warm-up call (which also faults pages in).

    Best, not median: this machine is shared, and other processes only ever make a run slower.
    """
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return min(samples)


def _time_pair(baseline: Callable[[], Any], fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Best seconds of baseline and fn, alternating them so both see the same background load."""
    base, own = [], []
    baseline()
    fn()
    for _ in range(repeats):
        for out, f in ((base, baseline), (own, fn)):
            t0 = time.perf_counter()
            f()
            out.append(time.perf_counter() - t0)
    return min(base), min(own)


def _fresh_memcpy_seconds(nbytes: int, repeats: int) -> float:
    """np.copyto between two fresh numpy buffers (numpy asks for huge pages), for reference."""
    src, dst = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
    return _time(lambda: np.copyto(dst, src), repeats)


def _mark_blocks(cache: torch.Tensor) -> None:
    """Fill the cache cheaply, then stamp each (layer, block) so misplaced copies are detected."""
    cache.view(torch.uint8).fill_(0x5A)
    layers, nb = cache.shape[0], cache.shape[1]
    stamp = cache.view(torch.uint8).view(layers, nb, -1)
    ids = torch.arange(layers * nb, dtype=torch.int64).view(layers, nb, 1)
    stamp[:, :, :8].copy_(ids.view(torch.uint8).view(layers, nb, 8))


def bench_block_size(block_size: int, args: argparse.Namespace) -> dict[str, Any]:
    lay = layouts.vllm_cpu_layout(
        num_layers=args.layers,
        num_kv_heads=args.heads,
        head_dim=args.head_dim,
        block_size=block_size,
        dtype=torch.float16,
        chunk_size=args.chunk_size,
    )
    bpc, chunks = lay.blocks_per_chunk, args.chunks
    num_blocks = max(args.cache_blocks_factor * bpc * chunks, bpc * chunks)
    cache = torch.empty((lay.num_layers, num_blocks, *lay.block_shape), dtype=torch.float16)
    _mark_blocks(cache)
    kv = EngineKV.from_tensors(lay, [cache[i] for i in range(lay.num_layers)])

    rng = np.random.default_rng(0)
    ids = rng.permutation(num_blocks)[: bpc * chunks].reshape(chunks, bpc).astype(np.int64)
    offsets = np.arange(chunks, dtype=np.int64) * lay.object_bytes
    total = chunks * lay.object_bytes
    arena = np.empty(total, dtype=np.uint8)
    arena.fill(0)
    abase = copy.address_of(arena, writable=True)
    addrs = abase + offsets
    moves = save_moves(ids.reshape(-1), bpc, range(chunks))  # whole chunks, the rows a store builds
    gather_rows = block_rows(kv, addrs, moves, gather=True)  # absolute addresses on both sides
    scatter_rows = block_rows(kv, addrs, moves, gather=False)

    # torch: index_select / index_copy_ per (chunk, layer) straight into / out of the object views.
    obj = torch.from_numpy(arena).view(torch.float16).view(chunks, lay.num_layers, bpc, *lay.block_shape)
    tids = [torch.from_numpy(ids[c]) for c in range(chunks)]

    def torch_gather() -> None:
        for c in range(chunks):
            for layer in range(lay.num_layers):
                torch.index_select(cache[layer], 0, tids[c], out=obj[c, layer])

    def torch_scatter() -> None:
        for c in range(chunks):
            for layer in range(lay.num_layers):
                cache[layer].index_copy_(0, tids[c], obj[c, layer])

    cache_slice = cache.view(torch.uint8).view(-1)[:total].numpy()  # same memory, contiguous
    baselines = {"gather": lambda: np.copyto(arena, cache_slice), "scatter": lambda: np.copyto(cache_slice, arena)}
    fresh_s = _fresh_memcpy_seconds(total, args.repeats)
    methods: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
        "cpp": (
            lambda: copy.batch_copy(0, 0, gather_rows, args.threads),
            lambda: copy.batch_copy(0, 0, scatter_rows, args.threads),
        ),
        "cpp-1thread": (lambda: copy.batch_copy(0, 0, gather_rows, 1), lambda: copy.batch_copy(0, 0, scatter_rows, 1)),
        "numpy-fallback": (
            lambda: _copy_fallback.batch_copy(0, 0, gather_rows),
            lambda: _copy_fallback.batch_copy(0, 0, scatter_rows),
        ),
        "torch": (torch_gather, torch_scatter),
    }
    if copy.backend_name() != "cpp":
        del methods["cpp"], methods["cpp-1thread"]

    # Correctness guard first (timing below rewrites the cache): all methods gather the same bytes.
    digests = set()
    for gather_fn, _ in methods.values():
        arena.fill(0)
        gather_fn()
        digests.add(copy.checksum_bytes(arena))
    if len(digests) != 1:
        raise SystemExit("the methods gathered different bytes")
    rows: list[dict[str, Any]] = []
    for name, (gather_fn, scatter_fn) in methods.items():
        for op, fn in (("gather", gather_fn), ("scatter", scatter_fn)):
            memcpy_s, s = _time_pair(baselines[op], fn, args.repeats)
            rows.append(
                {
                    "block_size": block_size,
                    "method": name,
                    "op": op,
                    "gbps": total / s / 1e9,
                    "memcpy_gbps": total / memcpy_s / 1e9,
                    "ratio": memcpy_s / s,
                    "seconds": s,
                }
            )
    verify = _verify_rows(gather_rows, scatter_rows, addrs, lay.object_bytes, arena, args)
    seg_s = _time(lambda: block_rows(kv, addrs, save_moves(ids.reshape(-1), bpc, range(chunks)), True), args.repeats)
    return {
        "verify": verify,
        "block_size": block_size,
        "bytes_per_run": total,
        "chunks": chunks,
        "object_bytes": lay.object_bytes,
        "segments": int(gather_rows.shape[0]),
        "segment_compute_us": seg_s * 1e6,
        "memcpy_fresh_numpy_gbps": total / fresh_s / 1e9,
        "rows": rows,
    }


def _verify_rows(
    gather_rows: np.ndarray,
    scatter_rows: np.ndarray,
    addrs: np.ndarray,
    object_bytes: int,
    arena: np.ndarray,
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """Verified (copy + checksum per object) vs unverified copy, per op and thread count."""
    if copy.backend_name() != "cpp":
        return []
    objects = object_table(addrs, object_bytes)
    sums = copy.copy_checksum(0, 0, gather_rows, objects, "dst", args.threads)
    want = [copy.checksum(int(a), object_bytes) for a in addrs]
    if sums != want or copy.copy_checksum(0, 0, scatter_rows, objects, "src", args.threads) != want:
        raise SystemExit("verified copy checksums differ from kvsum64 of the objects")
    out = []
    for threads in dict.fromkeys((args.threads, 1)):
        for op, (rows, side) in {"gather": (gather_rows, "dst"), "scatter": (scatter_rows, "src")}.items():
            plain_s, verified_s = _time_pair(
                lambda rows=rows, t=threads: copy.batch_copy(0, 0, rows, t),
                lambda rows=rows, side=side, t=threads: copy.copy_checksum(0, 0, rows, objects, side, t),
                args.repeats,
            )
            total = arena.nbytes
            out.append(
                {
                    "op": op,
                    "threads": threads or copy.default_threads(),
                    "plain_gbps": total / plain_s / 1e9,
                    "verified_gbps": total / verified_s / 1e9,
                    "ratio": plain_s / verified_s,
                }
            )
    return out


def _loadavg() -> str:
    """Other processes share this machine; their load explains noisy multi-thread figures."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block-sizes", default="128,32", help="comma-separated tokens per block")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--chunks", type=int, default=8, help="chunk objects per run (8 x 32 MiB = 256 MiB)")
    p.add_argument("--cache-blocks-factor", type=int, default=4, help="cache holds this many times the blocks copied")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="threads for the cpp method (0 = default)")
    p.add_argument("--torch-threads", type=int, default=0, help="torch.set_num_threads for the torch method (0 = keep)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    args = p.parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    sizes = [int(x) for x in args.block_sizes.split(",") if x]
    console = Console(stderr=True) if Console is not None and not args.json else None
    results = []
    for bs in sizes:
        if console is not None:
            with console.status(f"block_size={bs}: measuring..."):
                results.append(bench_block_size(bs, args))
        else:
            results.append(bench_block_size(bs, args))
    meta = {
        "backend": copy.backend_name(),
        "default_threads": copy.default_threads(),
        "loadavg": _loadavg(),
        "torch_threads": torch.get_num_threads(),
        "layers": args.layers,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "dtype": "float16",
        "chunk_size": args.chunk_size,
    }
    if args.json:
        json.dump({"meta": meta, "results": results}, sys.stdout, indent=2)
        print()
        return 0
    print(
        f"backend={meta['backend']} default_threads={meta['default_threads']} torch_threads={meta['torch_threads']}"
        f" loadavg={meta['loadavg']}"
        f" | {args.layers} layers x {args.heads} kv heads x head_dim {args.head_dim}, fp16, vllm_cpu layout"
    )
    for res in results:
        title = (
            f"block_size={res['block_size']}: {res['chunks']} chunks x {res['object_bytes'] / 2**20:.0f} MiB"
            f" = {res['bytes_per_run'] / 2**20:.0f} MiB per run, {res['segments']} segments"
            f" (computed in {res['segment_compute_us']:.0f} us); memcpy between fresh numpy buffers"
            f" {res['memcpy_fresh_numpy_gbps']:.2f} GB/s"
        )
        header = ("method", "op", "GB/s", "memcpy GB/s", "vs memcpy")
        cells = [
            (r["method"], r["op"], f"{r['gbps']:.2f}", f"{r['memcpy_gbps']:.2f}", f"{r['ratio']:.0%}")
            for r in res["rows"]
        ]
        if Console is not None:
            table = Table(title=title)
            for h in header:
                table.add_column(h, justify="left" if h in ("method", "op") else "right")
            for c in cells:
                table.add_row(*c)
            Console().print(table)
        else:
            print(title)
            for c in (header, *cells):
                print("  ".join(f"{v:>14}" for v in c))
        for v in res["verify"]:
            print(
                f"  verified {v['op']:<7} threads={v['threads']}: {v['verified_gbps']:.2f} GB/s vs unverified "
                f"{v['plain_gbps']:.2f} GB/s -> ratio {v['ratio']:.2f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
