"""`python -m bench.serving.reach` on a run's JSON, under .venv-vllm as the benchmark runs (its
workload builders import the benchmark's client): no engine is started."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvtestkit.engines.vllm_harness import REPO_ROOT, VLLM_PYTHON

pytestmark = [pytest.mark.vllm_engine, pytest.mark.timeout(300)]

COLS = ["session", "turn", "engine", "prompt_tokens", "cached_tokens", "sent_s", "ttft_s", "e2e_s"]


def reach(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(VLLM_PYTHON), "-m", "bench.serving.reach", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_by_computed_and_tail_read_a_chat_run_that_names_no_trace_sampling(tmp_path: Path) -> None:
    """A run of 2026-12-07 or before names no trace sampling: rebuilding its chat must not hand the
    trace's `sample` to the chat's builder (it failed with a TypeError)."""
    script = (
        "import json, sys\n"
        "import bench.serving.workloads as wl\n"
        "from bench.serving.run import SCALES, build_workload\n"
        "scale = {'chat': dict(SCALES['smoke']['chat'])}\n"
        "w = build_workload('chat', scale, None)\n"
        "rows = [[r.session, r.turn, 0, r.prompt_tokens, r.reachable, 0.0, 0.05 + 0.1 * r.turn, 1.0]"
        " for r in wl.reachable_per_request(w, 64)]\n"
        "none = [[s, t, e, p, 0, x, 0.1 + 0.1 * t, y] for s, t, e, p, _, x, _, y in rows]\n"
        f"cols = {COLS!r}\n"
        "run = {'scale': scale, 'fingerprints': {'chat': wl.fingerprint(w)}, 'chunk_size': 64,"
        " 'engine_block_size': 64, 'per_request': [{'none': {'chat': {'columns': cols, 'rows': none}},"
        " 'kvserver': {'chat': {'columns': cols, 'rows': rows}}}]}\n"
        "json.dump(run, open(sys.argv[1], 'w'))\n"
    )
    run = tmp_path / "run.json"
    made = subprocess.run(
        [str(VLLM_PYTHON), "-c", script, str(run)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=240
    )
    assert made.returncode == 0, made.stderr
    out = tmp_path / "tail.json"
    got = reach("--tail", str(run), "--workload", "chat", "--json", str(out))
    assert got.returncode == 0, got.stderr
    rows = json.loads(out.read_text())["tail"]
    assert {r["config"] for r in rows} == {"none", "kvserver"}
    got = reach("--by-computed", str(run), "--grain", "16", "--json", str(out))
    assert got.returncode == 0, got.stderr
    by = json.loads(out.read_text())
    assert {r["config"] for r in by} == {"none", "kvserver"}
    assert sum(r["requests"] for r in by if r["config"] == "kvserver") == len(
        json.loads(run.read_text())["per_request"][0]["kvserver"]["chat"]["rows"]
    )
    assert "tokens computed" in got.stdout


def test_reach_refuses_a_run_without_per_request_records(tmp_path: Path) -> None:
    run = tmp_path / "old.json"
    run.write_text(json.dumps({"per_request": []}))
    got = reach("--by-computed", str(run))
    assert got.returncode == 2
    assert "no per_request records" in got.stderr
    got = reach("--by-computed", str(run), "--grain", "0")
    assert got.returncode != 0 and "--grain must be positive" in got.stderr
