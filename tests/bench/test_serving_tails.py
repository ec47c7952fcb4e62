"""bench/serving/tails.py: what a run's TTFT percentiles are made of, read from its per-request records
(reach.py's command line runs under .venv-vllm: tests/vllm/test_bench_serving_reach.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import bench.serving.workloads as wl
from bench.serving.tails import by_computed, tail, ttft_floor

COLS = ["session", "turn", "engine", "prompt_tokens", "cached_tokens", "sent_s", "ttft_s", "e2e_s"]


def table(rows: list[tuple[int, int, int, int, float]]) -> dict[str, Any]:
    """per_request rows of (session, turn, prompt, cached, ttft)."""
    return {"columns": COLS, "rows": [[s, t, 0, p, c, 0.0, f, f + 1] for s, t, p, c, f in rows]}


def test_by_computed_groups_each_configurations_requests_by_the_tokens_they_computed() -> None:
    run = {
        "per_request": [
            {
                "none": {"chat": table([(0, 0, 640, 512, 0.06), (0, 1, 784, 0, 0.30), (1, 1, 784, 640, 0.08)])},
                "kvserver": {"chat": table([(0, 0, 640, 512, 0.07), (0, 1, 784, 640, 0.09), (1, 1, 784, 640, 0.11)])},
            }
        ]
    }
    rows = {(r["config"], r["computed_from"]): r for r in by_computed(run, "chat", 64)}
    assert set(rows) == {("none", 128), ("none", 768), ("kvserver", 128)}
    assert rows[("kvserver", 128)]["requests"] == 3
    assert rows[("kvserver", 128)]["ttft_p50_s"] == pytest.approx(0.09)
    assert rows[("none", 128)]["ttft_p50_s"] == pytest.approx(0.07)  # the turn-0 and the local hit
    assert rows[("none", 768)]["computed_to"] == 832
    # a finer grain tells 128 computed tokens from 144
    fine = {(r["config"], r["computed_from"]) for r in by_computed(run, "chat", 16)}
    assert ("kvserver", 128) in fine and ("kvserver", 144) in fine and ("none", 144) in fine


def _chat() -> wl.Workload:
    return wl.chat(users=2, rounds=2, system_tokens=128, user_tokens=64, max_tokens=8, think_s=0.1, stagger_s=0.1)


def test_tail_and_floor_read_a_run_of_a_chat() -> None:
    w = _chat()
    reached = {(r.session, r.turn): r for r in wl.reachable_per_request(w, 64)}
    none = [(s, t, r.prompt_tokens, 0, 0.2 if t else 0.1) for (s, t), r in reached.items()]
    mine = [(s, t, r.prompt_tokens, r.reachable, 0.05) for (s, t), r in reached.items()]
    run = {"per_request": [{"none": {"chat": table(none)}, "kvserver": {"chat": table(mine)}}]}
    rows = {r["config"]: r for r in tail(run, "chat", w, 64)}
    assert rows["kvserver"]["warm_vs_none"] == pytest.approx(0.05 / 0.2)
    best = ttft_floor(run, "chat", w, 64)[0]
    assert best["none_p90_s"] == pytest.approx(0.2)
    assert 0 < best["best_p90_vs_none"] < 1  # the later turns reach their history


def test_the_whole_traces_reachable_tokens_stop_at_the_first_block_never_seen(tmp_path: Path) -> None:
    lines = [
        {"input_length": 1100, "hash_ids": [1, 2, 3]},  # all new
        {"input_length": 1600, "hash_ids": [1, 2, 9, 4]},  # blocks 1 and 2 seen: 1024; 9 is new, 4 too
        {"input_length": 700, "hash_ids": [1, 4]},  # 1 seen, then 4 seen but partial (700 < 1024): 512
        {"input_length": 512, "hash_ids": [7]},  # one full block, never seen
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert wl.trace_reachable(path) == (4, 1100 + 1600 + 700 + 512, 1024 + 512)
