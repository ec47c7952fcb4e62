"""Record real polls of a small fleet for the `kvcli top` snapshot tests and docs/cli.md.

    uv run python tests/kvcli/make_top_recording.py tests/kvcli/data/top_recording.json

Starts three real kvservers, drives two of them with `bench server` traffic (one busy, one light,
one idle), polls every 0.5 s, kills the idle one part-way, and writes the polls as JSON. Replaying
a recording gives the snapshot tests a fixed screen; the live behaviour is tested against real
servers in test_top_pilot.py.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtestkit.serverproc import ServerProc, free_port

from kvcli.bench.kvshape import KVShape  # noqa: E402
from kvcli.bench.server import ServerBench  # noqa: E402
from kvcli.bench.workloads import WorkloadSpec  # noqa: E402
from kvcli.top.sources import DirectSource  # noqa: E402

POLLS, KILL_AT, INTERVAL = 24, 18, 0.5


def load(url: str, users: int, layers: int, seed: int) -> None:
    """One bench run for the whole recording (one engine registration), growing conversations."""
    spec = WorkloadSpec("multi-round-qa", users=users, rounds=10_000, context_tokens=1024, seed=seed)
    ServerBench(
        url,
        spec,
        KVShape(layers=layers, kv_heads=4, head_dim=64),
        mode="tcp",
        salt=f"rec-{seed}",
        duration=POLLS * INTERVAL + 1,
    ).run()


def main(out: Path) -> None:
    tmp = Path(tempfile.mkdtemp())
    servers = [ServerProc(free_port(), ["--l1-size-gb", "0.06"], tmp / f"s{i}.log").start() for i in range(3)]
    threads = [
        threading.Thread(target=load, args=(servers[0].url, 4, 4, 0)),
        threading.Thread(target=load, args=(servers[1].url, 1, 1, 1000)),
    ]
    source = DirectSource([s.url for s in servers], timeout=0.5)
    frames = []
    try:
        for t in threads:
            t.start()
        for i in range(POLLS):
            if i == KILL_AT:
                servers[2].kill()
            frames.append([asdict(s) for s in source.poll()])
            time.sleep(INTERVAL)
    finally:
        for t in threads:
            t.join()
        source.close()
        for s in servers:
            s.stop()
    out.write_text(json.dumps({"label": "3 recorded kvservers", "interval": INTERVAL, "frames": frames}))
    print(f"wrote {len(frames)} polls to {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
