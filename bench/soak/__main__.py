"""`python -m bench.soak [--quick | --minutes M] [--seed S] [--json PATH]`: run the chaos soak, print
its table (and JSON), exit 1 on a correctness failure (wrong bytes, lost durable objects) with the
seed and fault sequence needed to replay it."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from bench.soak.report import table
from bench.soak.run import run

QUICK_SEED = 4040
QUICK_S = 90.0  # the shortest run whose schedule (QUICK_SEED) meets every fault kind, with room after


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="90 s of load (every fault kind once), fixed seed (CI)")
    ap.add_argument("--minutes", type=float, default=30.0, help="length of a long run")
    ap.add_argument("--seed", type=int, default=None, help="replay a run (default: random; --quick: fixed)")
    ap.add_argument("--json", type=Path, default=None, help="also write the report as JSON here ('-': stdout)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, events)")
    args = ap.parse_args(argv)
    seconds = QUICK_S if args.quick else args.minutes * 60
    seed = args.seed if args.seed is not None else QUICK_SEED if args.quick else int.from_bytes(os.urandom(3))
    workdir = Path(tempfile.mkdtemp(prefix="kvsoak-"))
    try:
        report = run(seed, seconds, workdir)
    except BaseException:
        print(
            f"SOAK ERROR: replay with --seed {seed} --minutes {seconds / 60:g}; work directory {workdir}",
            file=sys.stderr,
        )
        raise
    failed = report["wrong_blocks"] > 0 or report["durable"]["lost"] > 0
    print(table(report))
    if args.json is not None:
        text = json.dumps(report, indent=2)
        print(text) if str(args.json) == "-" else args.json.write_text(text)
    if failed:
        print(f"SOAK FAILED: replay with --seed {seed} --minutes {seconds / 60:g}", file=sys.stderr)
        for line in report["fault_schedule"]:
            print(f"  {line}", file=sys.stderr)
        print(f"work directory kept: {workdir}", file=sys.stderr)
    elif not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
