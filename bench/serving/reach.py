"""What a cache could do for the serving benchmark's workloads at best, before any engine runs.

    .venv-vllm/bin/python -m bench.serving.reach [--scale full] [--window 5] [--json out.json]

Per workload: the reachable reuse (`workloads.reachable_reuse`: every earlier request's full blocks
kept, a prompt served up to its last token), so a goal on recomputed tokens can be checked against
what the workload allows; for the open-loop trace also its arrivals in windows of `--window`
seconds, with the prompt tokens each window must compute whatever the cache does: a burst of first
turns sets the TTFT tail, and no cache removes that work."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

import bench.serving.workloads as wl
from bench.serving.engines import BLOCK_SIZE
from bench.serving.run import SCALES, build_workload


def reach(scale_name: str, window_s: float, trace: Path | None = None) -> dict[str, Any]:
    scale = SCALES[scale_name]
    grain = min(scale["chunk_size"], BLOCK_SIZE)
    out: dict[str, Any] = {"scale": scale_name, "block_tokens": grain, "workloads": {}}
    for name in ("chat", "trace", "noreuse", "saturate"):
        w = build_workload(name, scale, trace)
        reusable, prompt = wl.reachable_tokens(w, grain)
        row: dict[str, Any] = {"requests": w.n_requests, "prompt_tokens": prompt, "reachable_tokens": reusable}
        row["reachable_pct"] = 100 * reusable / max(1, prompt)
        if w.concurrency is None and all(len(s.turns) == 1 for s in w.sessions):
            row["arrivals"] = [asdict(x) for x in wl.arrivals(w, grain, window_s)]
        out["workloads"][name] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default="full", choices=sorted(SCALES))
    ap.add_argument("--window", type=float, default=5.0, help="seconds per arrival window (default 5)")
    ap.add_argument("--trace", type=Path, default=None, help="the Mooncake conversation trace (default: ../shared)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures to this file")
    args = ap.parse_args(argv)
    if args.window <= 0:
        ap.error("--window must be positive")
    res = reach(args.scale, args.window, args.trace)
    out = Console(highlight=False)
    out.print(f"--{args.scale}: reuse reachable at {res['block_tokens']}-token blocks")
    for name, row in res["workloads"].items():
        out.print(
            f"  {name}: {row['requests']} requests, {row['prompt_tokens']} prompt tokens, "
            f"{row['reachable_tokens']} reachable ({row['reachable_pct']:.1f}%)"
        )
        if "arrivals" in row:
            t = Table("window (s)", "requests", "prompt tokens", "to compute at best", title=f"{name}: arrivals")
            for a in row["arrivals"]:
                t.add_row(
                    f"{a['start_s']:.0f}-{a['start_s'] + args.window:.0f}",
                    str(a["requests"]),
                    str(a["prompt_tokens"]),
                    str(a["to_compute"]),
                )
            out.print(t)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
