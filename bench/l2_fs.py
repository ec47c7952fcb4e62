"""The fs tier against a plain write/read of the same bytes, in the same run, on each medium.

Why: the tier's goal is the speed of its device, so its baseline is what a program would do without
it, with the same batching, threads and fsync policy: per batch of BATCH objects one worker-thread
hop, and per object `open + write (+ fsync) + close` (plain put; with fsync its directory once per
batch) or `open + readinto a preallocated buffer + close` (plain get). The tier does what the server
does: `FsAdapter.put_parts` (per object, in its worker thread: encode the header, then one `writev`
of header + the object's own buffer into an unnamed file in the object's directory, then link it
under its name); `FsAdapter.get_into` (one `preadv` into the destination and
`Serde.verify_in_place` right after it in the same thread), as the prefetcher does. Integrity is
always on: with the server's default (`--l2-verify reader`) the check reads the header (lengths, key
fingerprint, the body's kvsum64), and the body is checked by the kvsum64 every reader computes on its
own copy out of L1, whatever tier the object came from; a third side measures `--l2-verify server`,
which also hashes each landed body (XXH3-128) in the same thread.

The plain files are fanned out over 256 directories as the tier's are (on ext4 here, creating files
in one flat directory was 1.5x slower than across the fan-out). Every round writes new objects under
new names, as a cache's writes are (an object is written once), and removes the last round's
untimed: neither side pays what a file system charges for replacing a file's contents (ext4 starts
writeback at once when a file is truncated or renamed over, for crash safety).

A fourth side is the tier with `direct=1` (fs_direct.py): files framed with the body at a 4 KiB
offset, read with O_DIRECT straight into the slot when the page cache does not hold them (from the
disk), through the cache when it does. Destinations are 4 KiB-aligned slots of one mapping, as L1's.

Media: `tmpfs` (/dev/shm: page cache only), `warm` (a file system on a disk, pages cached), `disk`
(the same file system with fsync on both sides and every file dropped from the page cache with
POSIX_FADV_DONTNEED before each get, so reads come from the device). Rounds alternate which side runs
first, batch by batch; the figures are medians with min-max ranges over rounds, and the ratio is
taken per round.
"""

from __future__ import annotations

import asyncio
import functools
import mmap
import os
import secrets
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserver.l2 import Serde
from kvserver.l2.base import Landed, LazyBlob
from kvserver.l2.fs import FsAdapter
from kvserver.l2.serde import HEADER_BYTES
from kvtestkit.pagecache import drop_cache

BATCH = 16
SERVER_CHECK = "tier, --l2-verify server"  # the side that also hashes each landed body
DIRECT = "tier, direct=1"  # framed files, O_DIRECT reads of what the page cache does not hold
MEDIA = {"tmpfs": "/dev/shm", "warm": "/var/tmp", "disk": "/var/tmp"}


@dataclass
class Side:
    """One side of the comparison: put and get of one batch (object indices), each timed apart."""

    put: Callable[[range], Awaitable[None]]
    get: Callable[[range], Awaitable[None]]
    files: Callable[[], list[Path]]
    start: Callable[[], Awaitable[None]]
    next_round: Callable[[], Awaitable[None]]  # untimed: the round's objects removed, new names next


def _slot(size: int) -> int:
    return (size + 4095) // 4096 * 4096


def _batches(n: int) -> list[range]:
    return [range(i, min(n, i + BATCH)) for i in range(0, n, BATCH)]


async def _nothing() -> None:
    return None


def plain_side(root: Path, objs: list[memoryview], dests: list[memoryview], fsync: bool) -> Side:
    root.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []

    async def next_round() -> None:
        for p in paths:
            p.unlink(missing_ok=True)
        names = [secrets.token_hex(16) for _ in objs]  # fanned out over 256 directories, as the tier's
        paths[:] = [root / n[:2] / n[2:] for n in names]
        for p in paths:
            p.parent.mkdir(exist_ok=True)

    def put_batch(idx: range) -> None:
        for i in idx:
            fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, objs[i])
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        if fsync:  # durable names too: each directory written into, once per batch, as the tier does
            for directory in {paths[i].parent for i in idx}:
                dfd = os.open(directory, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)

    def get_batch(idx: range) -> None:
        for i in idx:
            fd = os.open(paths[i], os.O_RDONLY)
            try:
                assert os.readv(fd, [dests[i]]) == len(dests[i])
            finally:
                os.close(fd)

    async def put(idx: range) -> None:
        await asyncio.to_thread(put_batch, idx)

    async def get(idx: range) -> None:
        await asyncio.to_thread(get_batch, idx)

    return Side(put, get, lambda: paths, _nothing, next_round)


def tier_side(
    root: Path,
    objs: list[memoryview],
    dests: list[memoryview],
    fsync: bool,
    *,
    hash_landed: bool = False,
    direct: bool = False,
) -> Side:
    """The server's fs tier; `hash_landed` as with `--l2-verify server` (default: `reader`), `direct`
    as with `fs://...?direct=1`."""
    fs, serde = FsAdapter(root, fsync=fsync, direct=direct), Serde(hash_landed=hash_landed)
    keys: list[str] = []

    async def next_round() -> None:
        await fs.delete(keys)
        tag = secrets.token_hex(8)
        keys[:] = [f"kv1/bench/0123456789abcdef/w1r0/g0/-/{tag}{i:08x}" for i in range(len(objs))]

    async def put(idx: range) -> None:  # as the write-behind writer: each encoded by the writer thread
        await fs.put_parts(
            [(keys[i], LazyBlob(functools.partial(serde.encode_parts, keys[i], objs[i], 0))) for i in idx]
        )

    async def get(idx: range) -> None:  # as the prefetcher: read + check in place in one hop
        got = await fs.get_into([keys[i] for i in idx], [dests[i] for i in idx], HEADER_BYTES, serde.verify_in_place)
        if not all(isinstance(g, Landed) and g.verdict == 0 for g in got):
            raise AssertionError("an object read back from the tier failed its check")

    return Side(put, get, lambda: [fs.path_of(k) for k in keys], fs.start, next_round)


async def _timed(fn: Callable[[], Awaitable[None]]) -> float:
    t0 = time.perf_counter()
    await fn()
    return time.perf_counter() - t0


def describe_medium(path: str) -> str:
    """'<fstype> on <device>' for the mount holding `path` (from /proc/mounts)."""
    best = ("", "?", "?")
    real = os.path.realpath(path)
    with open("/proc/mounts") as fh:
        for line in fh:
            dev, mnt, fstype, *_ = line.split()
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best[0]):
                best = (mnt, fstype, dev)
    return f"{best[1]} on {best[2]}"


SideFactory = Callable[[Path, list[memoryview], list[memoryview], bool], Side]


async def run_medium(
    medium: str, objs: list[memoryview], rounds: int, extra: dict[str, SideFactory] | None = None
) -> dict[str, Any]:
    """`extra`: more sides measured in the same rounds (e.g. an older tier), reported as `others`."""
    base = Path(tempfile.mkdtemp(prefix="bench-l2fs-", dir=MEDIA[medium]))
    cold = medium == "disk"
    total = sum(len(o) for o in objs)
    arena = mmap.mmap(-1, sum(_slot(len(o)) for o in objs))  # page-aligned 4 KiB slots, as L1's
    at, dests = 0, []
    for o in objs:
        dests.append(memoryview(arena)[at : at + len(o)])
        at += _slot(len(o))
    for d in dests:  # fault the destination pages in once, as an L1 arena is
        d[:] = b"\1" * len(d)
    try:
        sides = {
            "plain": plain_side(base / "plain", objs, dests, cold),
            "tier": tier_side(base / "tier", objs, dests, cold),
            SERVER_CHECK: tier_side(base / "hashed", objs, dests, cold, hash_landed=True),
            DIRECT: tier_side(base / "direct", objs, dests, cold, direct=True),
            **{name: make(base / name, objs, dests, cold) for name, make in (extra or {}).items()},
        }
        names = list(sides)
        for side in sides.values():
            await side.start()
        times: dict[str, dict[str, list[float]]] = {s: {"put": [], "get": []} for s in sides}
        for r in range(rounds):  # sides alternate batch by batch: load drift hits both alike
            for side in sides.values():
                await side.next_round()
            for op in ("put", "get"):
                if op == "get" and cold:
                    for side in sides.values():
                        drop_cache(side.files())
                spent = dict.fromkeys(sides, 0.0)
                for b, idx in enumerate(_batches(len(objs))):
                    turn = (r + b) % len(names)
                    for name in names[turn:] + names[:turn]:
                        spent[name] += await _timed(functools.partial(getattr(sides[name], op), idx))
                for name, t in spent.items():
                    times[name][op].append(t)
            for o, d in zip(objs, dests, strict=True):
                assert o == d, "the bytes read back differ"
        out: dict[str, Any] = {"medium": medium, "where": f"{MEDIA[medium]} ({describe_medium(MEDIA[medium])})"}
        for op in ("put", "get"):
            out[op] = _versus(times["plain"][op], times["tier"][op], total)
        out["others"] = {
            n: {op: _versus(times["plain"][op], times[n][op], total) for op in ("put", "get")}
            for n in [SERVER_CHECK, DIRECT, *(extra or {})]
        }
        return out
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _versus(plain: list[float], tier: list[float], total: int) -> dict[str, dict[str, float]]:
    """MB/s of both sides and their ratio, taken per round."""
    return {
        "plain_MBps": _stats([total / t / 1e6 for t in plain]),
        "tier_MBps": _stats([total / t / 1e6 for t in tier]),
        "ratio": _stats([p / t for p, t in zip(plain, tier, strict=True)]),
    }


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


async def run(
    objs: list[bytes], rounds: int, media: list[str], extra: dict[str, SideFactory] | None = None
) -> list[dict[str, Any]]:
    views = [memoryview(o) for o in objs]
    return [await run_medium(m, views, rounds, extra) for m in media]


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'medium':<7}{'op':<5}{'plain MB/s (min-max)':>24}{'tier MB/s (min-max)':>24}{'tier/plain (min-max)':>22}"
    ]
    for row in rows:
        for op in ("put", "get"):
            f = row[op]
            cells = [
                f"{f[k]['median']:>6.0f} ({f[k]['min']:.0f}-{f[k]['max']:.0f})" for k in ("plain_MBps", "tier_MBps")
            ]
            ratio = f"{f['ratio']['median']:.2f} ({f['ratio']['min']:.2f}-{f['ratio']['max']:.2f})"
            lines.append(f"{row['medium']:<7}{op:<5}{cells[0]:>24}{cells[1]:>24}{ratio:>22}")
    for row in rows:
        for name, figures in row.get("others", {}).items():
            ratios = ", ".join(
                f"{op} {f['ratio']['median']:.2f} ({f['ratio']['min']:.2f}-{f['ratio']['max']:.2f})"
                for op, f in figures.items()
            )
            lines.append(f"  {row['medium']} {name}: x plain {ratios}")
    lines += [f"  {row['medium']}: {row['where']}" for row in rows]
    return "\n".join(lines)
