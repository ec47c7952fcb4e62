"""What a cache could do for the serving benchmark's workloads at best, before any engine runs.

    .venv-vllm/bin/python -m bench.serving.reach [--scale full] [--window 5] [--json out.json]
    .venv-vllm/bin/python -m bench.serving.reach --tail run.json [--workload trace]
    .venv-vllm/bin/python -m bench.serving.reach --by-computed run.json [--workload chat]

First the whole Mooncake trace as recorded (`workloads.trace_reachable`): the share of its prompt
tokens any cache could serve, before the replay samples its multi-turn conversations. Then per
workload: the reachable reuse (`workloads.reachable_reuse`: every earlier request's full blocks
kept, a prompt served up to its last token), so a goal on recomputed tokens can be checked against
what the workload allows; for the open-loop trace also its arrivals in windows of `--window`
seconds, with the prompt tokens each window must compute whatever the cache does: a burst of first
turns sets the TTFT tail, and no cache removes that work.

`--tail` reads a run's JSON (its `per_request`) and says what each configuration's slowest tenth of
a workload's requests was made of, round by round: how many were cold (at most a tenth of the
prompt reachable), and the median TTFT of the cold and of the other requests against `none`'s for
the same requests. A TTFT percentile set by cold requests moves only as far as the cache shortens
the queue they wait in. It then estimates how far `none`'s TTFT p50 and p90 could move at best:
each of `none`'s requests shortened by the share of its prompt any cache could serve (tails.py's
`ttft_floor`). `--json` writes both ({"tail": ..., "ttft_at_best": ...}).

`--by-computed` reads a run's JSON and puts, round by round, each configuration's median TTFT beside
the prompt tokens its requests computed (buckets of one engine block): whether a hit costs more than
computing what it left, against `none`'s requests that computed as little after a hit of vLLM's own
prefix cache (tails.py's `by_computed`). `--json` writes the rows."""

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
from bench.serving.tails import by_computed, tail, ttft_floor


def reach(scale_name: str, window_s: float, trace: Path | None = None) -> dict[str, Any]:
    scale = SCALES[scale_name]
    grain = min(scale["chunk_size"], BLOCK_SIZE)
    out: dict[str, Any] = {"scale": scale_name, "block_tokens": grain, "workloads": {}}
    for name in ("chat", "trace", "traceburst", "noreuse", "saturate"):
        w = build_workload(name, scale, trace)
        reusable, prompt = wl.reachable_tokens(w, grain)
        row: dict[str, Any] = {"requests": w.n_requests, "prompt_tokens": prompt, "reachable_tokens": reusable}
        row["reachable_pct"] = 100 * reusable / max(1, prompt)
        if w.concurrency is None and all(len(s.turns) == 1 for s in w.sessions):
            row["arrivals"] = [asdict(x) for x in wl.arrivals(w, grain, window_s)]
        out["workloads"][name] = row
    out["whole_trace"] = wl.trace_reachable(trace or wl.default_trace())
    return out


def print_tail(rows: list[dict[str, Any]], workload: str, out: Console) -> None:
    t = Table(
        "round",
        "config",
        "slowest 10%: cold",
        "cold TTFT s (vs none)",
        "other TTFT s (vs none)",
        title=f"{workload}: what the slowest tenth is made of",
    )
    for r in rows:
        cells = []
        for part in ("cold", "warm"):
            v, x = r[f"{part}_ttft_s"], r.get(f"{part}_vs_none")
            cells.append("-" if v is None else f"{v:.3f}" + (f" ({x:.2f}x)" if x is not None else ""))
        t.add_row(
            str(r["round"]), r["config"], f"{r['slowest_cold']} of {r['slowest']} ({r['cold']} cold in all)", *cells
        )
    out.print(t)


def run_workload(run: dict[str, Any], name: str, trace: Path | None) -> wl.Workload | None:
    """`name`'s requests as the run built them: those whose fingerprint the run recorded. A trace
    replay's sampling is tried both ways where the run does not name it (runs of 2026-12-07 and
    before)."""
    want = run.get("fingerprints", {}).get(name)
    scale = {n: dict(v) for n, v in run["scale"].items()}
    tries = [scale]
    if name in ("trace", "traceburst") and name in scale and "sample" not in scale[name]:
        tries = [{**scale, name: {**scale[name], "sample": s}} for s in ("spread", "first")]
    for sc in tries:
        w = build_workload(name, sc, trace)
        if want is None or wl.fingerprint(w) == want:
            return w
    return None


def print_best(rows: list[dict[str, Any]], workload: str, out: Console) -> None:
    t = Table(
        "round",
        "none p50 s",
        "at best (vs none)",
        "none p90 s",
        "at best (vs none)",
        title=f"{workload}: TTFT if every request were shortened by the share of its prompt a cache could serve",
    )
    for r in rows:
        cells = []
        for p in (50, 90):
            x = r[f"best_p{p}_vs_none"]
            cells += [
                f"{r[f'none_p{p}_s']:.3f}",
                f"{r[f'best_p{p}_s']:.3f}" + (f" ({x:.2f}x)" if x is not None else ""),
            ]
        t.add_row(str(r["round"]), *cells)
    out.print(t)


def read_run(path: Path) -> dict[str, Any] | None:
    """A bench.serving --json file with per-request records, or None (said on stderr)."""
    try:
        run = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"cannot read {path}: {exc}", file=sys.stderr)
        return None
    if not run.get("per_request"):
        print(f"{path} has no per_request records (a run from before they were kept)", file=sys.stderr)
        return None
    return dict(run)


def print_by_computed(rows: list[dict[str, Any]], workload: str, out: Console) -> None:
    configs = list(dict.fromkeys(r["config"] for r in rows))
    for rnd in sorted({r["round"] for r in rows}):
        t = Table("tokens computed", *configs, title=f"{workload}, round {rnd}: median TTFT s (requests)")
        cells: dict[tuple[int, str], str] = {}
        for r in rows:
            if r["round"] == rnd:
                cells[(r["computed_from"], r["config"])] = f"{r['ttft_p50_s']:.3f} ({r['requests']})"
        for lo in sorted({lo for lo, _ in cells}):
            hi = next(r["computed_to"] for r in rows if r["computed_from"] == lo)
            t.add_row(f"{lo}-{hi - 1}", *(cells.get((lo, c), "-") for c in configs))
        out.print(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default="full", choices=sorted(SCALES))
    ap.add_argument("--window", type=float, default=5.0, help="seconds per arrival window (default 5)")
    ap.add_argument("--trace", type=Path, default=None, help="the Mooncake conversation trace (default: ../shared)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures to this file")
    ap.add_argument(
        "--tail", type=Path, default=None, help="a bench.serving --json file: what its slowest requests were"
    )
    ap.add_argument(
        "--by-computed", type=Path, default=None, help="a bench.serving --json file: TTFT by tokens computed"
    )
    ap.add_argument("--grain", type=int, default=None, help="with --by-computed: bucket width (default: a block)")
    ap.add_argument("--workload", default=None, help="with --tail (default trace) or --by-computed (default chat)")
    args = ap.parse_args(argv)
    if args.window <= 0:
        ap.error("--window must be positive")
    if args.grain is not None and args.grain <= 0:
        ap.error("--grain must be positive")
    out = Console(highlight=False)
    if args.by_computed is not None:
        run = read_run(args.by_computed)
        if run is None:
            return 2
        grain = args.grain or run.get("engine_block_size", BLOCK_SIZE)
        rows = by_computed(run, args.workload or "chat", grain)
        print_by_computed(rows, args.workload or "chat", out)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
        return 0
    if args.tail is not None:
        args.workload = args.workload or "trace"
        run = read_run(args.tail)
        if run is None:
            return 2
        w = run_workload(run, args.workload, args.trace)
        if w is None:
            print(f"{args.tail}: cannot rebuild its {args.workload} requests (another trace file?)", file=sys.stderr)
            return 2
        grain = min(run["chunk_size"], run.get("engine_block_size", BLOCK_SIZE))
        rows = tail(run, args.workload, w, grain)
        print_tail(rows, args.workload, out)
        best = ttft_floor(run, args.workload, w, grain)
        print_best(best, args.workload, out)
        if args.json:
            args.json.write_text(json.dumps({"tail": rows, "ttft_at_best": best}, indent=2))
        return 0
    res = reach(args.scale, args.window, args.trace)
    n, prompt, served = res["whole_trace"]
    out.print(
        f"the whole trace as recorded: {n} requests, {prompt} prompt tokens, {served} reachable at its "
        f"512-token blocks ({100 * served / max(1, prompt):.1f}%)"
    )
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
