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
import statistics
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path


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


def _stacks(raw: Path) -> Iterator[tuple[list[str], int]]:
    """py-spy's raw format: one stack per line, frames joined by ";", then its sample count."""
    for line in raw.read_text().splitlines():
        if line.strip():
            stack, n = line.rsplit(" ", 1)
            yield stack.split(";"), int(n)


def connector_share(raw: Path) -> tuple[int, int, collections.Counter[str]]:
    """(samples, samples with a kvconnector frame, those per outermost kvconnector frame)."""
    total = ours = 0
    where: collections.Counter[str] = collections.Counter()
    for stack, n in _stacks(raw):
        total += n
        frame = next((f for f in stack if "kvconnector" in f), None)
        if frame is not None:
            ours += n
            where[frame] += n
    return total, ours, where


def frames(raw: Path) -> tuple[int, collections.Counter[str]]:
    """(samples, samples per function with it anywhere on the stack): a function's inclusive count,
    lines merged, thread frames dropped, so that two configurations' profiles can be subtracted."""
    total = 0
    where: collections.Counter[str] = collections.Counter()
    for stack, n in _stacks(raw):
        total += n
        for f in {_function(f) for f in stack if not f.startswith(("thread ", "process "))}:
            where[f] += n
    return total, where


def _function(frame: str) -> str:
    """ "fn (path/to/module.py:123)" -> "fn (module.py)"."""
    name, _, place = frame.partition(" (")
    return f"{name} ({place.rsplit('/', 1)[-1].split(':', 1)[0].rstrip(')')})"


@dataclass
class Profiled:
    """One configuration's profile of one workload: requests, CPU and on-CPU samples."""

    config: str
    requests: int
    wall_s: float
    cpu: dict[str, float]  # engines, kvserver (CPU s), and per process kind: user and system
    idle_waits: float
    procs: list[tuple[int, str]]
    samples: dict[str, tuple[int, int]]  # process -> (samples, in kvconnector)
    where: collections.Counter[str] = field(default_factory=collections.Counter)  # outermost kvconnector frame
    functions: collections.Counter[str] = field(default_factory=collections.Counter)  # inclusive, all processes


def profile(args: argparse.Namespace, config: str, work: Path, spy: str) -> Profiled:
    model = bs.build_model(work / "model", bs.MODEL)
    workload = bs.build_workload(args.workload, bs.SCALES[args.scale], None)
    plan = bs.plan_kv_cache({args.workload: workload}, args.kv_share)
    run = work / config
    dep = eng.start(config, model, args.engines, plan["max_model_len"], run, kv_blocks=plan["blocks"])
    try:
        urls = [e.url for e in dep.engines]
        bs.warm_up(urls)
        procs = engine_processes(dep)
        spies = [
            subprocess.Popen(
                [spy, "record", "--pid", str(pid), "--format", "raw", "--nonblocking", "-r", str(args.rate)]
                + ["-o", str(run / f"{pid}.txt")],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for pid, _ in procs
        ]
        t0 = {pid: psutil.Process(pid).cpu_times() for pid, _ in procs}
        cpu0, before = dep.cpu_seconds(), scrape(urls)
        records, wall = asyncio.run(run_workload(RoundRobin(urls), workload, lambda: None))
        cpu = {k: v - cpu0[k] for k, v in dep.cpu_seconds().items()}
        for pid, name in procs:
            t = psutil.Process(pid).cpu_times()
            kind = name.split(" ", 1)[1]
            cpu[f"{kind} user"] = cpu.get(f"{kind} user", 0.0) + t.user - t0[pid].user
            cpu[f"{kind} system"] = cpu.get(f"{kind} system", 0.0) + t.system - t0[pid].system
        idle_waits = delta(scrape(urls), before).get("kvserver_idle_waits", 0.0)
        for s in spies:
            s.send_signal(signal.SIGINT)  # py-spy writes its samples when interrupted
        for s in spies:
            s.wait(60)
    finally:
        dep.stop()
    out = Profiled(config, len(records), wall, cpu, idle_waits, procs, {})
    for pid, name in procs:
        raw = run / f"{pid}.txt"
        if not raw.exists():
            continue
        n, k, w = connector_share(raw)
        out.samples[name] = (n, k)
        out.where.update(w)
        out.functions.update(frames(raw)[1])
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            shutil.copy(raw, args.keep / f"{config}-{name.replace(' ', '-')}-{pid}.txt")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="kvserver", choices=sorted(eng.CONFIGS), help="the configuration profiled")
    ap.add_argument(
        "--against",
        default=None,
        choices=sorted(eng.CONFIGS),
        help="also profile this configuration (e.g. none), alternating, and print where the CPU samples differ",
    )
    ap.add_argument("--rounds", type=int, default=1, help="profiles of each configuration, alternating")
    ap.add_argument("--workload", default="noreuse", choices=("chat", "trace", "traceburst", "noreuse"))
    ap.add_argument("--scale", default="full", choices=sorted(bs.SCALES))
    ap.add_argument("--engines", type=int, default=3, help="engines behind round robin (the serving benchmark's)")
    ap.add_argument("--kv-share", type=float, default=bs.KV_SHARE, help="each engine's KV cache, as in bench.serving")
    ap.add_argument("--rate", type=int, default=100, help="py-spy samples per second and process")
    ap.add_argument("--top", type=int, default=25, help="functions listed in the difference")
    ap.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="copy py-spy's raw stacks here (one <config>-<process>-<pid>.txt each, flamegraph.pl's input)",
    )
    args = ap.parse_args()
    spy = py_spy()
    configs = [args.config] if args.against is None else [args.against, args.config]
    got: dict[str, list[Profiled]] = {c: [] for c in configs}
    for rnd in range(args.rounds):
        for c in configs[::-1] if rnd % 2 else configs:
            with tempfile.TemporaryDirectory(prefix="kvserver-profile-") as tmp:
                got[c].append(profile(args, c, Path(tmp), spy))
            report(args, got[c][-1])
    if args.against is not None:
        difference(got[args.against], got[args.config], args.top)
    return 0


def report(args: argparse.Namespace, p: Profiled) -> None:
    server_share = 100 * p.cpu["kvserver"] / max(1e-9, p.cpu["engines"])
    print(
        f"\n{p.config}, {args.workload} ({p.requests} requests in {p.wall_s:.1f} s); CPU s: engines "
        f"{p.cpu['engines']:.2f}, kvserver {p.cpu['kvserver']:.2f} ({server_share:.2f}% of the engines'); "
        + ", ".join(f"{k} {v:.2f}" for k, v in sorted(p.cpu.items()) if k not in ("engines", "kvserver"))
    )
    # steps vLLM ran only to poll the connector's background copies run in vLLM's code, not ours
    print(
        f"steps with nothing to compute that waited for a background copy: {p.idle_waits:.0f} "
        f"({p.idle_waits / max(1, p.requests):.1f} per request)\n"
    )
    print("| process | on-CPU samples | in kvconnector | share |")
    print("|---|---:|---:|---:|")
    total = ours = 0
    for _, name in p.procs:
        n, k = p.samples.get(name, (0, 0))
        total, ours = total + n, ours + k
        print(f"| {name} | {n} | {k} | {100 * k / max(1, n):.2f}% |")
    print(f"| all | {total} | {ours} | {100 * ours / max(1, total):.2f}% |")
    if p.where:
        print("\nwhere (outermost kvconnector frame):")
        for frame, n in p.where.most_common(8):
            print(f"  {n:6d}  {frame}")


def difference(base: list[Profiled], other: list[Profiled], top: int) -> None:
    """Samples per request of every function, inclusive, median over the rounds: the functions whose
    share grew or shrank most from `base` to `other`. Why: a connector's cost may sit in vLLM's own
    code (more steps, other batch shapes) rather than in kvconnector's frames."""

    def per_request(ps: list[Profiled], f: str) -> float:
        return statistics.median(p.functions[f] / max(1, p.requests) for p in ps)

    def total(ps: list[Profiled]) -> float:
        return statistics.median(sum(n for n, _ in p.samples.values()) / max(1, p.requests) for p in ps)

    b, o = base[0].config, other[0].config
    print(
        f"\nsamples per request, median of {len(base)} and {len(other)} profiles: "
        f"{b} {total(base):.1f}, {o} {total(other):.1f}"
    )
    names = set().union(*(p.functions for p in base + other))
    rows = sorted(((per_request(other, f) - per_request(base, f), f) for f in names), key=lambda r: -abs(r[0]))
    print(f"\n| function (inclusive) | {b} | {o} | difference |\n|---|---:|---:|---:|")
    for d, f in rows[:top]:
        print(f"| `{f}` | {per_request(base, f):.2f} | {per_request(other, f):.2f} | {d:+.2f} |")


if __name__ == "__main__":
    raise SystemExit(main())
