"""Token hit rate against L1 capacity on a Mooncake-format trace, per eviction policy, next to
Belady's offline optimum and plain (object-level, prefix-unaware) LRU.

The simulation replays the trace through the server's own L1 code in-process (kvserver.tracesim);
`--server` replays a prefix of the trace against a real kvserver (tokens synthesised per hash id,
real lookup/store/commit over TCP) at a few capacities and prints both hit rates side by side.

  uv run python -m bench.trace_replay                         # table (markdown) on stdout
  uv run --with matplotlib python -m bench.trace_replay --png docs/capacity-hit-rate.png
  uv run python -m bench.trace_replay --server --limit 1500   # simulation vs real server
  uv run python -m bench.trace_replay --bounds 0.05 --jobs 1   # lhd calibrated on the whole trace

Default trace: the FAST'25 Mooncake conversation trace (kvcache-ai/Mooncake, FAST25-release/traces,
Apache-2.0), looked up in ../shared/traces or /work/shared/traces.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from kvserver.l1.eviction import POLICIES
from kvtestkit.tracebounds import FEATURES, calibrated
from kvtestkit.tracesim import (
    BLOCK_TOKENS,
    OBJECT_BYTES,
    Request,
    belady,
    load_trace,
    plain_lru,
    simulate,
    unique_blocks,
)

if TYPE_CHECKING:
    from kvprotocol import Client

NAME = "mooncake_conversation_trace.jsonl"
FRACTIONS = [0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0]
_TRACE: list[Request] = []


def default_trace() -> Path:
    here = Path(__file__).resolve().parent.parent
    for cand in (here.parent / "shared" / "traces" / NAME, Path("/work/shared/traces") / NAME):
        if cand.exists():
            return cand
    raise SystemExit(f"no trace found; pass --trace (looked for ../shared/traces/{NAME})")


def _init(path: str, limit: int | None) -> None:
    global _TRACE
    _TRACE = load_trace(path, limit)


def _run(job: tuple[str, int]) -> tuple[str, int, float]:
    what, cap = job
    if what == "optimal":
        return what, cap, belady(_TRACE, cap)
    if what == "plain-lru":
        return what, cap, plain_lru(_TRACE, cap)
    return what, cap, simulate(_TRACE, what, cap)


def _bound(job: tuple[str, int, int]) -> tuple[str, int, list[float]]:
    features, cap, passes = job
    return features, cap, calibrated(_TRACE, cap, features, passes)


def bounds(path: Path, limit: int | None, fractions: list[float], passes: int, jobs: int) -> str:
    """Markdown: lhd online and calibrated on the whole trace in advance (tracebounds.py), per
    capacity, next to LRU and the optimum."""
    trace = load_trace(path, limit)
    unique = unique_blocks(trace)
    caps = [max(1, round(unique * f)) for f in fractions]
    with ProcessPoolExecutor(jobs, initializer=_init, initargs=(str(path), limit)) as pool:
        plain = {(w, c): r for w, c, r in pool.map(_run, [(w, c) for w in ("optimal", "lru", "lhd") for c in caps])}
        cal = {(f, c): r for f, c, r in pool.map(_bound, [(f, c, passes) for f in FEATURES for c in caps])}
    head = ["capacity", "blocks", "optimal", "lru", "lhd (online)"]
    for f in FEATURES:
        head += [f"lhd learning the whole trace ({f})"] + [f"calibrated {f}, pass {i}" for i in range(1, passes + 1)]
    lines = ["| " + " | ".join(head) + " |", "|---:|---:|" + "---:|" * (len(head) - 2)]
    for frac, cap in zip(fractions, caps, strict=True):
        row = [f"{100 * frac:g}%", str(cap)] + [f"{100 * plain[w, cap]:.1f}" for w in ("optimal", "lru", "lhd")]
        row += [f"{100 * r:.1f}" for f in FEATURES for r in cal[f, cap]]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def curves(
    path: Path, limit: int | None, fractions: list[float], policies: list[str], jobs: int
) -> tuple[int, dict[str, dict[float, float]]]:
    trace = load_trace(path, limit)
    unique = unique_blocks(trace)
    caps = {f: max(1, round(unique * f)) for f in fractions}
    work = [(w, caps[f]) for w in ["optimal", "plain-lru", *policies] for f in fractions]
    out: dict[str, dict[float, float]] = {}
    by_cap = {c: f for f, c in caps.items()}
    with ProcessPoolExecutor(jobs, initializer=_init, initargs=(str(path), limit)) as pool:
        for what, cap, rate in pool.map(_run, work):
            out.setdefault(what, {})[by_cap[cap]] = rate
    return unique, out


def table(unique: int, res: dict[str, dict[float, float]], fractions: list[float]) -> str:
    names = list(res)
    lines = [
        "| capacity (% of unique blocks) | blocks | " + " | ".join(names) + " |",
        "|---:|---:|" + "---:|" * len(names),
    ]
    for f in fractions:
        row = [f"{100 * f:g}%", str(max(1, round(unique * f)))]
        row += [f"{100 * res[n][f]:.1f}" for n in names]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def half_point(res: dict[str, dict[float, float]], fractions: list[float]) -> float:
    """The smallest capacity at which plain LRU reaches half of the optimum."""
    for f in fractions:
        if res["plain-lru"][f] >= 0.5 * res["optimal"][f]:
            return f
    return fractions[-1]


def plot(res: dict[str, dict[float, float]], fractions: list[float], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for name, series in res.items():
        style = {"optimal": dict(color="black", linestyle="--"), "plain-lru": dict(color="grey", linestyle=":")}
        ax.plot(
            [100 * f for f in fractions],
            [100 * series[f] for f in fractions],
            marker="o",
            markersize=3,
            label=name,
            **style.get(name, {}),
        )
    ax.set_xscale("log")
    ax.set_xlabel("L1 capacity, % of the trace's unique 512-token blocks (log)")
    ax.set_ylabel("token hit rate, %")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)


# -- real server -----------------------------------------------------------------------------------
def replay_server(
    trace: list[Request],
    policy: str,
    capacity_blocks: int,
    extra: Sequence[str] = (),
    settle: Callable[[Client], None] | None = None,
) -> tuple[float, int]:
    """Token hit rate of a real kvserver (chunk size 512, 4 KiB objects) replaying the trace;
    `extra`: more `kvserver start` flags; `settle(client)` runs before each request (bench/tiers.py
    waits there for the L2 writes of the one before)."""
    from kvprotocol import Client
    from kvtestkit.ports import free_port
    from kvtestkit.tracereplay import register_trace, replay_request

    port = free_port()
    exe = Path(sys.executable).parent / "kvserver"
    gb = capacity_blocks * OBJECT_BYTES / (1 << 30)
    token = secrets.token_hex(16)  # every op but ping needs one
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            [
                str(exe),
                "start",
                "--port",
                str(port),
                "--l1-size-gb",
                repr(gb),
                "--http-port",
                "0",
                "--chunk-size",
                str(BLOCK_TOKENS),
                "--eviction-policy",
                policy,
                "--api-token",
                token,
                "--log-level",
                "warning",
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            cwd=tmp,
        )
        try:
            with Client(f"tcp://127.0.0.1:{port}", timeout=5.0, token=token) as c:
                for _ in range(100):
                    try:
                        c.ping()
                        break
                    except Exception:
                        time.sleep(0.1)
                ks = register_trace(c)
                capacity = c.describe().l1["capacity_bytes"] // OBJECT_BYTES
                hit_tokens = total = 0
                for req in trace:
                    if settle is not None:
                        settle(c)
                    total += req.input_tokens
                    hit_tokens += replay_request(c, ks, req.blocks) * BLOCK_TOKENS
        finally:
            proc.terminate()
            proc.wait(10)
    return hit_tokens / max(1, total), capacity


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=None)
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--policies", default=",".join(sorted(POLICIES)))
    ap.add_argument("--fractions", default=",".join(map(str, FRACTIONS)))
    ap.add_argument("--jobs", type=int, default=max(1, min(4, (os.cpu_count() or 2) - 1)))
    ap.add_argument("--png", type=Path, default=None, help="write the curves as a PNG (needs matplotlib)")
    ap.add_argument("--json", type=Path, default=None, help="write the raw results as JSON")
    ap.add_argument("--server", action="store_true", help="confirm the simulation against a real kvserver")
    ap.add_argument("--server-fractions", default="0.02,0.1")
    ap.add_argument(
        "--bounds",
        default=None,
        metavar="FRACTIONS",
        help="instead of the table: lhd calibrated on the whole trace in advance, at these capacities",
    )
    ap.add_argument("--passes", type=int, default=2, help="calibrated replays per capacity (--bounds)")
    args = ap.parse_args()
    path = args.trace or default_trace()
    policies = [p for p in args.policies.split(",") if p]
    fractions = [float(f) for f in args.fractions.split(",")]
    if args.bounds:
        t0 = time.monotonic()
        text = bounds(path, args.limit, [float(f) for f in args.bounds.split(",")], args.passes, args.jobs)
        print(f"{path.name}: token hit rate, % ({time.monotonic() - t0:.0f} s)\n\n{text}")
        return
    if args.server:
        trace = load_trace(path, args.limit)
        unique = unique_blocks(trace)
        print(f"{path.name}: {len(trace)} requests, {unique} unique full blocks")
        print("| policy | capacity | blocks | simulated % | real server % |\n|---|---:|---:|---:|---:|")
        for f in [float(x) for x in args.server_fractions.split(",")]:
            for p in policies:
                real, cap = replay_server(trace, p, max(1, round(unique * f)))
                sim = simulate(trace, p, cap)
                print(f"| {p} | {100 * f:g}% | {cap} | {100 * sim:.2f} | {100 * real:.2f} |", flush=True)
        return
    t0 = time.monotonic()
    unique, res = curves(path, args.limit, fractions, policies, args.jobs)
    print(
        f"{path.name}: {unique} unique full blocks; token hit rate, % of all input tokens "
        f"({time.monotonic() - t0:.0f} s)\n"
    )
    print(table(unique, res, fractions))
    f = half_point(res, fractions)
    print(
        f"\nplain LRU first reaches half of optimal at {100 * f:g}% capacity: optimal {100 * res['optimal'][f]:.1f}, "
        f"plain LRU {100 * res['plain-lru'][f]:.1f}, " + ", ".join(f"{p} {100 * res[p][f]:.1f}" for p in policies)
    )
    if args.json:
        args.json.write_text(json.dumps({"unique_blocks": unique, "results": res}, indent=1))
    if args.png:
        plot(res, fractions, args.png, f"{path.name} ({unique} unique blocks)")
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
