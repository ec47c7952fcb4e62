"""First copies through a fresh arena mapping: page-faulting vs populated (kvprotocol ShmMapping.populate).

Why: an engine maps the server's arena once per process, and every page of that mapping takes a
page fault on its first copy in or out, even when the server allocated the pages up front
(--prefault). The engine now populates its mapping on a background thread right after mapping it.
This measures, on an allocated /dev/shm file like a prefaulted arena: the first write and the first
read of a fresh mapping, the same on a mapping populated first, and a second (warm) copy as the
baseline; each as GB/s of the engine's copy kernel on one thread, with its ratio to the warm copy.

    uv run python -m bench.populate              # 512 MiB arena, 64 MiB copies
    uv run python -m bench.populate --json
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import time

import numpy as np

from kvconnector import copy as kvcopy
from kvprotocol._shm import ShmMapping

MIB = 1 << 20


def copy_gbps(src: int, dst: int, nbytes: int) -> float:
    segs = np.array([[0, 0, nbytes]], dtype=np.int64)
    t0 = time.perf_counter()
    kvcopy.batch_copy(src, dst, segs, 1)
    return nbytes / (time.perf_counter() - t0) / 1e9


def one_run(arena: ShmMapping, buf: np.ndarray, populate: bool) -> dict[str, float]:
    """A fresh mapping of the arena: first write, warm write, first read of another region, warm read."""
    m = ShmMapping(arena.name, arena.size)
    try:
        t0 = time.perf_counter()
        populated = m.populate() if populate else 0
        populate_s = time.perf_counter() - t0
        n, local = buf.nbytes, kvcopy.address_of(buf, writable=True)
        out = {
            "populate_s": populate_s,
            "populated_bytes": populated,
            "first_write": copy_gbps(local, m.address, n),
            "warm_write": copy_gbps(local, m.address, n),
            "first_read": copy_gbps(m.address + n, local, n),
            "warm_read": copy_gbps(m.address + n, local, n),
        }
    finally:
        m.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arena-mib", type=int, default=512)
    ap.add_argument("--copy-mib", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    arena = ShmMapping(f"kvbench-populate-{secrets.token_hex(4)}", args.arena_mib * MIB, create=True)
    try:
        fd = os.open(arena.path, os.O_RDWR)
        os.posix_fallocate(fd, 0, arena.size)  # what kvserver --prefault does
        os.close(fd)
        buf = np.random.default_rng(0).integers(0, 255, args.copy_mib * MIB, dtype=np.uint8)
        runs = {
            name: [one_run(arena, buf, populate) for _ in range(args.runs)]
            for name, populate in (("faulting", False), ("populated", True))
        }
    finally:
        arena.close()
        arena.path.unlink(missing_ok=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    if args.json:
        print(
            json.dumps(
                {"arena_mib": args.arena_mib, "copy_mib": args.copy_mib, "runs": args.runs, "medians": med}, indent=2
            )
        )
        return
    print(
        f"{args.copy_mib} MiB copies through a fresh mapping of an allocated {args.arena_mib} MiB arena, "
        f"medians of {args.runs} runs, one copy thread"
    )
    for name, m in med.items():
        extra = f" (populate took {1000 * m['populate_s']:.0f} ms)" if m["populated_bytes"] else ""
        print(
            f"{name:>9}: first write {m['first_write']:.2f} GB/s ({m['first_write'] / m['warm_write']:.0%} "
            f"of warm {m['warm_write']:.2f}), first read {m['first_read']:.2f} GB/s "
            f"({m['first_read'] / m['warm_read']:.0%} of warm {m['warm_read']:.2f}){extra}"
        )


if __name__ == "__main__":
    main()
