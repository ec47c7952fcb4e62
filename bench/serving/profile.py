"""What the connector costs a serving engine, counted in CPU samples rather than throughput.

Why: on a shared 2-core host one run's throughput moves by 10-40% from host noise alone (see
docs/benchmarks.md), far more than the 3% a connector may cost when nothing is reused, and CPU
seconds per request move almost as much. A sampling profile of the engines' own processes does
not: it says which share of their on-CPU time was spent in the connector's code, whatever the
host's other load.

The script starts one configuration of the serving benchmark (bench/serving/run.py's engines and
kvserver), warms it up, and runs one workload while py-spy samples every process of every engine
(API server, engine core, worker) on CPU only. It prints, per process, the samples taken, those
with a kvconnector frame on the stack, and the kvserver's CPU time next to the engines'.

  .venv-vllm/bin/python -m bench.serving.profile                      # kvserver, noreuse
  .venv-vllm/bin/python -m bench.serving.profile --config kvserver-sync --workload chat
  .venv-vllm/bin/python -m bench.serving.profile --keep prof/   # and keep the raw stacks

py-spy comes with the workspace's dev tools (`uv sync` puts it in .venv/bin); it needs to be
allowed to read other processes' memory (root, or ptrace_scope 0).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any


import psutil  # a dependency of vLLM: this runs with .venv-vllm

import bench.serving.run as bs
import bench.serving.engines as eng
from bench.serving.client import delta, run_workload, scrape
from bench.serving.router import RoundRobin

REPO = Path(__file__).resolve().parents[2]


def py_spy() -> str:
    found = shutil.which("py-spy") or str(REPO / ".venv" / "bin" / "py-spy")
    if not Path(found).exists():
        raise SystemExit("py-spy not found: run `uv sync` (it is a dev tool of the workspace)")
    return found


def engine_processes(dep: eng.Deployment) -> list[tuple[int, str]]:
    out = []
    for i, e in enumerate(dep.engines):
        root = psutil.Process(e.proc.pid)
        for p in [root, *root.children(recursive=True)]:
            name = p.name() if p.name().startswith("VLLM") else "api-server" if p is root else p.name()
            if "resource_tracker" not in " ".join(p.cmdline()):
                out.append((p.pid, f"engine{i} {name}"))
    return out


def connector_share(raw: Path) -> tuple[int, int, collections.Counter[str]]:
    """(samples, samples with a kvconnector frame, those per outermost kvconnector frame)."""
    total = ours = 0
    where: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        if not line.strip():
            continue
        stack, n = line.rsplit(" ", 1)
        total += int(n)
        frame = next((f for f in stack.split(";") if "kvconnector" in f), None)
        if frame is not None:
            ours += int(n)
            where[frame] += int(n)
    return total, ours, where


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="kvserver", choices=sorted(eng.CONFIGS))
    ap.add_argument("--workload", default="noreuse", choices=("chat", "trace", "noreuse"))
    ap.add_argument("--scale", default="full", choices=sorted(bs.SCALES))
    ap.add_argument("--rate", type=int, default=100, help="py-spy samples per second and process")
    ap.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="copy py-spy's raw stacks here (one <name>.txt per process, flamegraph.pl's input)",
    )
    args = ap.parse_args()
    spy = py_spy()
    with tempfile.TemporaryDirectory(prefix="kvserver-profile-") as tmp:
        work = Path(tmp)
        model = bs.build_model(work / "model", bs.MODEL)
        dep = eng.start(args.config, model, 2, bs.MAX_MODEL_LEN, work / "run")
        try:
            urls = [e.url for e in dep.engines]
            bs.warm_up(urls)
            procs = engine_processes(dep)
            spies = [
                subprocess.Popen(
                    [
                        spy,
                        "record",
                        "--pid",
                        str(pid),
                        "--format",
                        "raw",
                        "--nonblocking",
                        "-r",
                        str(args.rate),
                        "-o",
                        str(work / f"{pid}.txt"),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for pid, _ in procs
            ]
            workload = bs.build_workload(args.workload, bs.SCALES[args.scale], None)
            cpu0, before = dep.cpu_seconds(), scrape(urls)
            records, wall = asyncio.run(run_workload(RoundRobin(urls), workload, lambda: None))
            cpu = {k: v - cpu0[k] for k, v in dep.cpu_seconds().items()}
            idle_waits = delta(scrape(urls), before).get("kvserver_idle_waits", 0.0)
            for s in spies:
                s.send_signal(signal.SIGINT)  # py-spy writes its samples when interrupted
            for s in spies:
                s.wait(60)
        finally:
            dep.stop()
        report(args, procs, work, records, wall, cpu, idle_waits)
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            for pid, name in procs:
                if (work / f"{pid}.txt").exists():
                    shutil.copy(work / f"{pid}.txt", args.keep / f"{name.replace(' ', '-')}.txt")
    return 0


def report(
    args: argparse.Namespace,
    procs: list[tuple[int, str]],
    work: Path,
    records: list[Any],
    wall: float,
    cpu: dict[str, float],
    idle_waits: float,
) -> None:
    server_share = 100 * cpu["kvserver"] / max(1e-9, cpu["engines"])
    print(
        f"{args.config}, {args.workload} ({len(records)} requests in {wall:.1f} s); CPU s: engines "
        f"{cpu['engines']:.2f}, kvserver {cpu['kvserver']:.2f} ({server_share:.2f}% of the engines')"
    )
    # steps vLLM ran only to poll the connector's background copies run in vLLM's code, not ours
    print(
        f"steps with nothing to compute that waited for a background copy: {idle_waits:.0f} "
        f"({idle_waits / max(1, len(records)):.1f} per request)\n"
    )
    print("| process | on-CPU samples | in kvconnector | share |")
    print("|---|---:|---:|---:|")
    total = ours = 0
    where: collections.Counter[str] = collections.Counter()
    for pid, name in procs:
        raw = work / f"{pid}.txt"
        n, k, w = connector_share(raw) if raw.exists() else (0, 0, collections.Counter())
        total, ours = total + n, ours + k
        where.update(w)
        print(f"| {name} | {n} | {k} | {100 * k / max(1, n):.2f}% |")
    print(f"| all | {total} | {ours} | {100 * ours / max(1, total):.2f}% |")
    if where:
        print("\nwhere (outermost kvconnector frame):")
        for frame, n in where.most_common(8):
            print(f"  {n:6d}  {frame}")


if __name__ == "__main__":
    raise SystemExit(main())
