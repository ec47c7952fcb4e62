"""L1 + L2 as one cache on a Mooncake-format trace: token hit rate of the two tiers (the server's
L1Cache and policy over its L2 directory and policy, written on L1 eviction: kvtestkit.tiersim)
against every single-tier policy and Belady's optimum at their combined capacity.

  uv run python -m bench.tiers                                  # the table (L1 5%; L2 10, 20, 50%)
  uv run python -m bench.tiers --curve 0,0.02,0.05,0.1,0.2,0.3,0.5,0.95 [--png docs/tiers-hit-rate.png]
  uv run python -m bench.tiers --server --limit 1000            # simulation vs a real kvserver + fs L2

Sizes are fractions of the trace's unique 512-token blocks. The goal the table checks: the two
tiers lose at most 0.5 points against the best single-tier policy of their combined size.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from kvprotocol import Client
from kvserver.l1.eviction import POLICIES
from kvtestkit.tiersim import two_tier
from kvtestkit.tracesim import OBJECT_BYTES, Request, belady, load_trace, simulate, unique_blocks

from .trace_replay import default_trace, replay_server

GOAL = 0.5  # points of token hit rate
_TRACE: list[Request] = []

Job = tuple[str, str, int, int]  # (kind, policy or "l1/l2" policies, L1 blocks, L2 blocks)


def _init(path: str, limit: int | None) -> None:
    global _TRACE
    _TRACE = load_trace(path, limit)


def _run(job: Job) -> tuple[Job, tuple[float, int, int]]:
    kind, what, c1, c2 = job
    if kind == "optimal":
        return job, (belady(_TRACE, c1 + c2), 0, 0)
    if kind == "single":
        return job, (simulate(_TRACE, what, c1 + c2), 0, 0)
    l1p, l2p = what.split("/")
    r = two_tier(_TRACE, l1p, c1, c2, l2_policy=l2p)
    return job, (r.hit_rate, r.l2_writes, r.free_drops)


def table(path: Path, limit: int | None, l1: float, l2s: list[float], pairs: list[str], jobs: int) -> str:
    trace = load_trace(path, limit)
    unique = unique_blocks(trace)
    c1 = round(l1 * unique)
    sizes = [(f, round(f * unique)) for f in l2s]
    work: list[Job] = [("optimal", "", c1, c2) for _, c2 in sizes]
    work += [("single", p, c1, c2) for p in sorted(POLICIES) for _, c2 in sizes]
    work += [("tiers", pair, c1, c2) for pair in pairs for _, c2 in sizes]
    with ProcessPoolExecutor(jobs, initializer=_init, initargs=(str(path), limit)) as pool:
        res = dict(pool.map(_run, work))
    head = ["L2", "L1 + L2 blocks", "optimal", "best single tier"]
    head += [f"L1 {p.split('/')[0]} + L2 {p.split('/')[1]}" for p in pairs]
    head += ["gap (points)", "goal", "L2 writes", "free drops"]
    lines = [
        f"{path.name}: {unique} unique blocks; L1 {100 * l1:g}% = {c1} blocks; token hit rate, %\n",
        "| " + " | ".join(head) + " |",
        "|---:|---:|---:|---|" + "---:|" * len(pairs) + "---:|---|---:|---:|",
    ]
    for f, c2 in sizes:
        singles = {p: res["single", p, c1, c2][0] for p in POLICIES}
        best = max(singles, key=lambda p: singles[p])
        tiers = [res["tiers", pair, c1, c2] for pair in pairs]
        top = max(range(len(pairs)), key=lambda i: tiers[i][0])
        gap = 100 * (singles[best] - tiers[top][0])
        row = [f"{100 * f:g}%", str(c1 + c2), f"{100 * res['optimal', '', c1, c2][0]:.2f}"]
        row += [f"{100 * singles[best]:.2f} ({best})"] + [f"{100 * t[0]:.2f}" for t in tiers]
        row += [f"{gap:+.2f}", "met" if gap <= GOAL else "not met", f"{tiers[top][1]:,}", f"{tiers[top][2]:,}"]
        lines.append("| " + " | ".join(row) + " |")
    lines.append(
        "\ngap: best single tier minus the best two-tier row (negative: the tiers do better); "
        "writes and free drops of that row (objects L1 evicted that L2 already held)."
    )
    return "\n".join(lines)


def curve(path: Path, limit: int | None, l1: float, l2s: list[float], pair: str, jobs: int) -> dict[str, list[float]]:
    """Hit rate against L2 size at a fixed L1: L1 + L2, one lhd cache of the sum, the optimum."""
    trace = load_trace(path, limit)
    unique = unique_blocks(trace)
    c1 = round(l1 * unique)
    caps = [round(f * unique) for f in l2s]
    work: list[Job] = [(k, w, c1, c2) for c2 in caps for k, w in (("tiers", pair), ("single", "lhd"), ("optimal", ""))]
    with ProcessPoolExecutor(jobs, initializer=_init, initargs=(str(path), limit)) as pool:
        res = dict(pool.map(_run, work))
    return {
        f"L1 + L2 ({pair})": [100 * res["tiers", pair, c1, c2][0] for c2 in caps],
        "lhd, one cache of the sum": [100 * res["single", "lhd", c1, c2][0] for c2 in caps],
        "optimal": [100 * res["optimal", "", c1, c2][0] for c2 in caps],
    }


def settle(c: Client) -> None:
    """Wait until every demotion queued so far is written (or skipped), so that the next request sees
    L2 as the simulation does (it writes at once)."""
    deadline = time.monotonic() + 30
    while True:
        d = c.call("describe").result
        q = d["l2_queue"]
        written = sum(x["puts"] for x in d["l2"]) + q["skipped_evicted"]
        if written >= q["admission"]["demoted"] and not q["deletes_in_flight"]:
            return
        if time.monotonic() > deadline:
            raise RuntimeError("L2 writes did not finish")
        time.sleep(0.001)


def against_server(path: Path, limit: int, l1: float, l2s: list[float], pairs: list[str]) -> str:
    """Markdown: the simulated two-tier hit rate next to a real kvserver's with an fs L2."""
    trace = load_trace(path, limit)
    unique = unique_blocks(trace)
    lines = ["| L1/L2 policies | L1 blocks | L2 blocks | simulated % | real server % |", "|---|---:|---:|---:|---:|"]
    for pair in pairs:
        l1p, l2p = pair.split("/")
        for f in l2s:
            c2 = round(f * unique)
            with tempfile.TemporaryDirectory() as tmp:
                extra = ["--l2", f"fs://{tmp}/l2", "--l2-admission", "evicted", "--l2-eviction-policy", l2p]
                extra += ["--l2-prefetch-timeout", "60"]  # a loaded machine must not cut a prefetch short
                extra += ["--l2-capacity-gb", repr(c2 * OBJECT_BYTES / (1 << 30))]
                real, c1 = replay_server(trace, l1p, round(l1 * unique), extra, settle)
            sim = two_tier(trace, l1p, c1, c2, l2_policy=l2p).hit_rate
            lines.append(f"| {pair} | {c1} | {c2} | {100 * sim:.2f} | {100 * real:.2f} |")
    return "\n".join(lines)


def plot(series: dict[str, list[float]], l1: float, l2s: list[float], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for name, ys in series.items():
        style = {"optimal": {"color": "black", "linestyle": "--"}}.get(name, {})
        ax.plot([100 * f for f in l2s], ys, marker="o", markersize=3, label=name, **style)  # type: ignore[arg-type]
    ax.set_xlabel(f"L2 capacity, % of the trace's unique blocks (L1: {100 * l1:g}%)")
    ax.set_ylabel("token hit rate, %")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=None)
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--l1", type=float, default=0.05)
    ap.add_argument("--l2", default="0.1,0.2,0.5", help="L2 sizes for the table")
    ap.add_argument("--pairs", default="lhd/lru,lhd/lhd", help="L1/L2 policy pairs")
    ap.add_argument("--curve", default=None, metavar="FRACTIONS", help="instead of the table: L2 sizes of a curve")
    ap.add_argument("--png", type=Path, default=None, help="with --curve: write it as a PNG (needs matplotlib)")
    ap.add_argument("--server", action="store_true", help="simulation vs a real kvserver with an fs L2")
    ap.add_argument("--jobs", type=int, default=max(1, min(4, (os.cpu_count() or 2) - 1)))
    args = ap.parse_args()
    path = args.trace or default_trace()
    t0 = time.monotonic()
    if args.server:
        pairs = [p for p in args.pairs.split(",") if p]
        l2s = [float(x) for x in args.l2.split(",")]
        print(against_server(path, args.limit or 1000, args.l1, l2s, pairs))
    elif args.curve:
        l2s = [float(x) for x in args.curve.split(",")]
        pair = args.pairs.split(",")[0]
        series = curve(path, args.limit, args.l1, l2s, pair, args.jobs)
        print("| L2 | " + " | ".join(series) + " |\n|---:|" + "---:|" * len(series))
        for i, f in enumerate(l2s):
            print(f"| {100 * f:g}% | " + " | ".join(f"{ys[i]:.2f}" for ys in series.values()) + " |")
        if args.png:
            plot(series, args.l1, l2s, args.png)
            print(f"wrote {args.png}")
    else:
        pairs = [p for p in args.pairs.split(",") if p]
        print(table(path, args.limit, args.l1, [float(x) for x in args.l2.split(",")], pairs, args.jobs))
    print(f"\n({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
