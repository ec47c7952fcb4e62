"""An L2 hit at the server, without vLLM: the prefetch alone, a streamed load, and an L1 hit.

Why: an L2 hit's TTFT in bench/vllm_ttft.py is bounded by the server's prefetch (read, check and
place every object into L1) and by the streamed load behind it; this measures those two directly,
next to an L1-hit load of the same prompt, in the same run, with no engine and no model.

A real `kvserver` with an fs L2 (on /var/tmp: ext4, page cache warm) is filled through a real
EngineClient (`--tokens` tokens of `--kv-kib` KiB of KV per token, vllm_cpu layout, fp32, one object
per 256-token chunk) and stopped gracefully (the write-behind flushed to L2). Each step then runs on a
fresh arena (a server just started over that L2 directory: L1 empty, its arena never written) and
on a warm arena (one running server whose L1 is cleared first: pages used before, a long-running
server's steady state); `--arenas` picks. Steps, in an order that alternates round by round:

  prefetch   a lookup with wait: answered once every object landed in L1 (the prefetch alone)
  streamed   a lookup (wait=False, expect) then EngineClient.load_streamed of the whole prompt into
             host tensors of the engine's geometry (what the vLLM connector does), end to end
  l1         after the streamed load: a new session's lookup + load of the same prompt (an L1 hit)

`--baseline-bin` names another `kvserver` (an older checkout's .venv/bin/kvserver): its servers run
the same steps, alternating with this checkout's in every round, and the ratios this / baseline are
printed. With `--server-flag=--prefault` each server is measured once its prefault finished.
Medians with [min-max] over rounds; ratios are taken per round. The machine's other work shows in
single rounds: compare medians, and only figures of the same run.

    uv run python -m bench.l2_prefetch                  # 4,096 tokens, 64 KiB/token, 7 rounds
    uv run python -m bench.l2_prefetch --server-flag=--prefault --baseline-bin ../old/.venv/bin/kvserver
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

from kvconnector.engine_client import EngineClient
from kvconnector.layouts import vllm_cpu_layout
from kvprotocol import new_session_id
from kvtestkit.kvhelpers import wait_prefaulted
from kvtestkit.serverproc import KVServer, ServerProc

CHUNK, BLOCK, LAYERS, HEAD_DIM = 256, 16, 8, 128
MODEL = "bench/l2-prefetch"
T = TypeVar("T")


def _layout(heads: int) -> Any:
    return vllm_cpu_layout(
        num_layers=LAYERS,
        num_kv_heads=heads,
        head_dim=HEAD_DIM,
        block_size=BLOCK,
        dtype=torch.float32,
        chunk_size=CHUNK,
    )


def _kv(blocks: int, heads: int, fill: float | None) -> list[torch.Tensor]:
    shape = (blocks, heads, BLOCK, 2 * HEAD_DIM)
    if fill is not None:
        return [torch.full(shape, fill) for _ in range(LAYERS)]
    g = torch.Generator().manual_seed(1)
    return [torch.randn(shape, generator=g) for _ in range(LAYERS)]


class Bench:
    """One L2 root, servers over it started one after another, one engine geometry."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        # KiB per token = layers * 2 (K, V) * heads * head_dim * 4 bytes
        self.heads = args.kv_kib * 1024 // (LAYERS * 2 * HEAD_DIM * 4)
        self.tokens = np.random.default_rng(3).integers(0, 50_000, args.tokens)
        self.blocks = args.tokens // BLOCK
        self.tmp, self.l2 = tmp, Path(tempfile.mkdtemp(prefix="l2-", dir=args.l2_dir))
        gb = max(1.0, 2.5 * args.tokens * args.kv_kib / (1 << 20))
        self.args = (
            "--l1-size-gb",
            f"{gb:.1f}",
            "--chunk-size",
            str(CHUNK),
            "--l2",
            f"fs://{self.l2}",
            "--l2-prefetch-timeout",
            "30",
            *args.server_flag,
        )
        self.dst = _kv(self.blocks, self.heads, 0.0)
        self.ids = list(range(self.blocks))
        self.n = 0
        self.stale: set[int] = set()
        self.env = {k: v for k, v in os.environ.items() if k.startswith("KVSERVER_")}

    def server(self, exe: Path | None = None) -> ServerProc:
        self.n += 1
        srv = KVServer(self.tmp / f"kvserver-{self.n}.log", *self.args)
        srv.env, srv.bin = self.env, exe
        srv.start()
        if "--prefault" in self.args:
            wait_prefaulted(srv)
        return srv

    def engine(self, srv: ServerProc) -> EngineClient:
        e = EngineClient(srv.url, MODEL, 1, 0, [_layout(self.heads)], timeout=60.0)
        assert e.register(self.dst), "register failed"
        return e

    def fill(self) -> int:
        srv = self.server()
        try:
            with EngineClient(srv.url, MODEL, 1, 0, [_layout(self.heads)], timeout=60.0) as e:
                assert e.register(_kv(self.blocks, self.heads, None))
                r = e.save(self.tokens, self.ids)
                assert r.ok, r.error
        finally:
            srv.stop()  # graceful: the write-behind queue is flushed into L2
        return sum(1 for f in (self.l2 / "objects").rglob("*") if f.is_file())

    def prefetch(self, srv: ServerProc, e: EngineClient) -> float:
        t0 = time.perf_counter()
        hit = e.lookup(self.tokens).hit_tokens
        dt = time.perf_counter() - t0
        assert hit == len(self.tokens) // CHUNK * CHUNK, f"prefetch brought {hit} tokens"
        return dt

    def streamed(self, srv: ServerProc, e: EngineClient) -> tuple[float, float]:
        """The streamed load, then an L1 hit of the same prompt (a new session) on the same server."""
        n = len(self.tokens) // CHUNK * CHUNK
        s1, s2 = new_session_id(), new_session_id()
        t0 = time.perf_counter()
        first = e.lookup(self.tokens, session=s1, wait=False, expect=True)
        assert first.error is None and first.expected_tokens == n, first
        res = e.load_streamed(s1, self.tokens, self.ids, 0, n)
        streamed = time.perf_counter() - t0
        assert res.ok and res.loaded_tokens == n, res
        t0 = time.perf_counter()
        hit = e.lookup(self.tokens, session=s2).hit_tokens
        res = e.load(s2, self.tokens, self.ids, 0, hit)
        l1 = time.perf_counter() - t0
        assert hit == n and res.ok and res.loaded_tokens == n, res
        assert e.verify_failures == 0
        return streamed, l1

    def fresh(self, exe: Path | None, step: Callable[[ServerProc, EngineClient], T]) -> T:
        """`step` on a server just started over the L2 root: L1 empty, its arena never touched."""
        srv = self.server(exe)
        try:
            with self.engine(srv) as e:
                return step(srv, e)
        finally:
            srv.stop()

    def warm(self, srv: ServerProc, e: EngineClient, step: Callable[[ServerProc, EngineClient], T]) -> T:
        """`step` on a running server after its L1 was cleared: slots whose pages were used before
        (a long-running server's steady state)."""
        with srv.client() as admin:
            admin.call("clear")
        if srv.port in self.stale:  # the last streamed load's ended prefetch: its record answers the next miss
            assert not e.lookup(self.tokens, wait=False).pending
            self.stale.discard(srv.port)
        if step == self.streamed:
            self.stale.add(srv.port)
        return step(srv, e)


def _fmt(xs: list[float], unit: str = "s") -> str:
    p = 3 if unit == "s" else 2
    return f"{statistics.median(xs):.{p}f} [{min(xs):.{p}f}-{max(xs):.{p}f}]"


def _ratios(xs: list[float], ys: list[float]) -> list[float]:
    return [x / y for x, y in zip(xs, ys, strict=True)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--kv-kib", type=int, default=64, help="KiB of KV per token (a multiple of 8)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--l2-dir", default="/var/tmp", help="where the fs tier's directory is made")
    ap.add_argument("--server-flag", action="append", default=[], help="an extra kvserver flag (repeatable)")
    ap.add_argument(
        "--baseline-bin",
        help="another `kvserver` (say an older checkout's .venv/bin/kvserver): its servers alternate with this one's",
    )
    ap.add_argument("--arenas", default="fresh,warm", help="which of fresh,warm to measure")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.arenas = args.arenas.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="bench-l2-prefetch-"))
    bench = Bench(args, tmp)
    try:
        objects = bench.fill()
        mib = len(bench.tokens) // CHUNK * CHUNK * args.kv_kib / 1024
        print(f"{objects} objects in L2, {mib:.0f} MiB; {args.rounds} rounds; server flags {args.server_flag}")
        sides: dict[str, Path | None] = {"this": None}
        if args.baseline_bin:
            sides["baseline"] = Path(args.baseline_bin)
        runs: dict[str, dict[str, list[float]]] = {side: {} for side in sides}
        warm = {side: bench.server(exe) for side, exe in sides.items()}
        engines = {side: bench.engine(srv) for side, srv in warm.items()}
        try:
            for side, exe in sides.items():  # unrecorded: page cache, imports, the warm arenas' pages touched
                bench.fresh(exe, bench.prefetch)
                bench.warm(warm[side], engines[side], bench.prefetch)
            for r in range(args.rounds):
                steps = [
                    (side, name, functools.partial(fn, *pre, step))
                    for side, exe in sides.items()
                    for name, fn, pre in (
                        ("fresh", bench.fresh, (exe,)),
                        ("warm", bench.warm, (warm[side], engines[side])),
                    )
                    if name in args.arenas
                    for step in (bench.prefetch, bench.streamed)
                ]
                for side, arena, call in steps if r % 2 == 0 else steps[::-1]:
                    got = call()
                    out = runs[side]
                    if isinstance(got, tuple):
                        out.setdefault(f"{arena}-streamed", []).append(got[0])
                        out.setdefault(f"{arena}-l1", []).append(got[1])
                    else:
                        out.setdefault(f"{arena}-prefetch", []).append(got)
                line = "; ".join(
                    f"{side} " + " ".join(f"{k} {v[-1]:.3f}" for k, v in sorted(out.items()))
                    for side, out in runs.items()
                )
                print(f"round {r}: {line}", flush=True)
        finally:
            for side in sides:
                engines[side].close()
                warm[side].stop()
    finally:
        shutil.rmtree(bench.l2, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    for side, out in runs.items():
        for arena, label in (("fresh", "fresh arena (a server just started)"), ("warm", "warm arena (L1 cleared)")):
            if arena not in args.arenas:
                continue
            pre, st, l1 = out[f"{arena}-prefetch"], out[f"{arena}-streamed"], out[f"{arena}-l1"]
            gib = [mib / 1024 / t for t in pre]
            print(f"{side}, {label}:")
            print(f"  prefetch alone  {_fmt(pre)} s  ({_fmt(gib, 'x')} GiB/s)  x L1 hit {_fmt(_ratios(pre, l1), 'x')}")
            print(f"  streamed load   {_fmt(st)} s  x L1 hit {_fmt(_ratios(st, l1), 'x')}")
            print(f"  L1-hit load     {_fmt(l1)} s")
    if "baseline" in runs:
        this, base = runs["this"], runs["baseline"]
        print("this / baseline, per round:")
        for k in sorted(this):
            print(f"  {k:15s} {_fmt(_ratios(this[k], base[k]), 'x')}")
    if args.json:
        print(json.dumps({"args": vars(args), "runs": runs}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
