"""bench.warm_restart runs end to end on a small arena: every object it filled is adopted and verified
after each `kill -9` (the bench's figures are timings and are not checked here)."""

from __future__ import annotations

import json
import subprocess
import sys

from kvtestkit.serverproc import REPO_ROOT


def test_small_run_adopts_everything_it_filled() -> None:
    cmd = [sys.executable, "-m", "bench.warm_restart", "--gb", "0.05", "--object-mb", "1", "--rounds", "2", "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert out["stored"] > 0
    for r in out["rounds"]:
        assert r["adopted"] == r["verified"] == out["stored"] and r["rejected"] == 0


def test_every_prompt_acknowledged_before_a_kill_under_load_is_whole_after_it() -> None:
    cmd = [sys.executable, "-m", "bench.warm_restart", "--gb", "0.25", "--object-mb", "1"]
    res = subprocess.run(
        [*cmd, "--kill-under-load", "2", "--json"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert out["acknowledged_prompts"] > 0 and out["rejected_objects"] == 0
    assert out["whole_after_restart"] == out["acknowledged_prompts"]
