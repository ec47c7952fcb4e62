"""`python -m bench.serving --smoke` end to end: two real vLLM OpenAI servers behind the round-robin
router, one kvserver, a short multi-round chat. The benchmark's numbers must add up (prompt tokens =
prefix cache + kvserver + recomputed, from vLLM's own /metrics, and equal to the per-request
`cached_tokens` the servers streamed), and the second engine must load the shared system prompt
that the first one stored. Timings are printed, never asserted."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvtestkit.serverproc import KVSERVER_BIN
from kvtestkit.engines.vllm_harness import REPO_ROOT, VLLM_PYTHON

pytestmark = [pytest.mark.vllm_engine, pytest.mark.timeout(900)]


def test_smoke_run_adds_up_and_hits_kvserver(tmp_path: Path) -> None:
    assert KVSERVER_BIN.exists(), "run `uv sync` first"
    out = tmp_path / "serving.json"
    proc = subprocess.run(
        [
            str(VLLM_PYTHON),
            "-m",
            "bench.serving",
            "--smoke",
            "--json",
            str(out),
            "--model-dir",
            str(tmp_path / "model"),
        ],
        capture_output=True,
        text=True,
        timeout=840,
        cwd=REPO_ROOT,
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res = json.loads(out.read_text())
    chat = res["configs"]["kvserver"]["workloads"]["chat"]
    src = chat["sources"]
    assert chat["requests"] == res["workload_sizes"]["chat"]
    assert chat["per_engine_requests"] == [2, 2]  # round robin over both engines
    assert src["prompt"] == (
        src["prefix_cache"] + src["kvserver_l1"] + src["kvserver_l2"] + src["other_external"] + src["recomputed"]
    )
    assert src["cached_per_request"] == src["prompt"] - src["recomputed"]
    # One user, four rounds: round 1 runs on engine 0, which stores the system prompt (512 tokens, two
    # chunks); round 2 runs on engine 1, which must load it from kvserver instead of recomputing it.
    assert src["kvserver_l1"] >= 512
    assert chat["kvserver"]["kvserver_loaded"] == src["kvserver_l1"] + src["kvserver_l2"]
    assert chat["kvserver"]["kvserver_load_errors"] == 0
