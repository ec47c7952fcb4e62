"""`python -m bench.serving --smoke` with a kvserver per engine and KV-aware routing, against the most
round robin could reuse.

Two real vLLM OpenAI servers, each with its own kvserver registered with a real kvcoordinator and
publishing KV events to it; one user chats four rounds. Round robin would send the rounds to
alternating engines, so every other round finds none of its history where it lands: what it could
reuse at best is computed from the workload (`reachable_tokens` over two separate caches), not run.
The KV-aware router asks the coordinator, which names the kvserver holding the conversation, so the
later rounds stay on the engine that served the first one and reuse its history. The kvscore router
(the hint weighed against load and its own memory of where it sent each prompt) keeps every later
round there too. Routing decisions and token sources are asserted; timings are printed, never
asserted."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import bench.serving.workloads as wl
from kvtestkit.serverproc import KVSERVER_BIN
from kvtestkit.engines.vllm_harness import REPO_ROOT, VLLM_PYTHON

pytestmark = [pytest.mark.vllm_engine, pytest.mark.timeout(900)]


def test_kv_routing_keeps_chat_on_its_engine(tmp_path: Path) -> None:
    assert KVSERVER_BIN.exists(), "run `uv sync` first"
    out = tmp_path / "serving.json"
    proc = subprocess.run(
        [
            str(VLLM_PYTHON),
            "-m",
            "bench.serving",
            "--smoke",
            "--topology",
            "per-engine",
            "--routers",
            "kv,kvscore",
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
    kv, ks = (res["configs"][c]["workloads"]["chat"] for c in ("kvserver+kv", "kvserver+kvscore"))
    for r in (kv, ks):
        s = r["sources"]
        assert r["requests"] == 4
        assert (
            s["prompt"]
            == s["prefix_cache"] + s["kvserver_l1"] + s["kvserver_l2"] + s["other_external"] + s["recomputed"]
        )
        assert r["kvserver"]["kvserver_load_errors"] == 0
    # KV-aware: the first round finds nothing anywhere (a fallback); the coordinator routes later rounds
    # to the kvserver that stored the conversation's system prompt, i.e. back to the first round's engine.
    via = kv["routing"]["via"]
    assert via.get("kv", 0) >= 2, via
    assert via.get("kv-error", 0) == 0, via
    assert kv["routing"]["kv_routed_same_engine"]
    assert kv["routing"]["later_turns_same_engine"] >= 2
    # kvscore: the first round has no hit anywhere (the least loaded engine); every later round goes back
    # to it, by the index's hint or, should a lookup time out on a loaded host, by the router's memory.
    via = ks["routing"]["via"]
    assert sum(via.values()) == 4 and via.get("kv", 0) >= 2 and "rr" not in via, via
    assert ks["routing"]["later_turns_same_engine"] == 3
    # ... so more of the prompts come from cache (vLLM's prefix cache or the engine's own kvserver) than
    # round robin over the two engines' separate caches could reach with every block kept.
    chat = wl.chat(**res["scale"]["chat"])
    rr_best, prompt = wl.reachable_tokens(chat, min(res["chunk_size"], res["engine_block_size"]), caches=2)
    assert prompt == kv["sources"]["prompt"] == ks["sources"]["prompt"]
    for r in (kv, ks):
        reused = r["sources"]["prompt"] - r["sources"]["recomputed"]
        assert reused > rr_best, (reused, rr_best)
