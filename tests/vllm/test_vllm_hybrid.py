"""Hybrid models in real vLLM (CPU) with its hybrid KV cache manager on (the connector implements
SupportsHMA): each KV cache group is one object group with its own block table.

Sliding + global (a tiny random Gemma-3: a 96-token windowed layer, then a global one): two KV cache
groups. Engine A stores a 700-token prompt; engine B (another process) reuses the 512 tokens its
prompt shares, loading the global group's blocks and only the window of the sliding group (vLLM
gives the blocks out of the window its null block; writing one of them, or reading a window from
anywhere else, fails the load or changes the tokens). A load that fails is recomputed. Greedy
tokens equal a run without the connector in every case. One module-scoped set of engine runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvtestkit.engines.tiny_model import random_prompt
from kvtestkit.engines.vllm_harness import VLLM_PYTHON, EngineRun, build_variant, prompt, run_engine
from kvtestkit.serverproc import ServerFactory
from vllm_cases import kv_config

pytestmark = pytest.mark.vllm_engine

P_STORE = random_prompt(700, seed=46)  # 2 full chunks of 256: a window snapshot and full chunks at 512
P_REUSE = P_STORE[:520] + random_prompt(80, seed=47)  # shares 2 chunks with P_STORE
HYBRID_LINE = "KV cache groups (hybrid manager) as object groups"


@dataclass(frozen=True)
class Runs:
    ref: EngineRun  # no connector, no prefix cache: what recompute gives
    store: EngineRun
    reuse: EngineRun
    corrupt: EngineRun  # the load's first chunk overwritten with garbage and reported failed


@pytest.fixture(scope="module")
def gemma3_runs(tmp_path_factory: pytest.TempPathFactory, kvserver_factory: ServerFactory) -> Runs:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} missing: build it with scripts/make-vllm-env.sh")
    model = build_variant(tmp_path_factory.mktemp("tiny-gemma3-hma") / "model", "build_gemma3")
    ref = run_engine(model, [[prompt(P_STORE)], [prompt(P_REUSE)]], llm_kwargs={"enable_prefix_caching": False})
    server = kvserver_factory()
    store = run_engine(model, [[prompt(P_STORE)]], kv_transfer_config=kv_config(server.url))
    reuse = run_engine(model, [[prompt(P_REUSE)]], kv_transfer_config=kv_config(server.url))
    corrupt = run_engine(
        model, [[prompt(P_REUSE)]], kv_transfer_config=kv_config(server.url, debug_fail_load_chunks=[0])
    )
    return Runs(ref, store, reuse, corrupt)


def test_sliding_global_runs_the_hybrid_manager(gemma3_runs: Runs) -> None:
    for run in (gemma3_runs.store, gemma3_runs.reuse):
        assert "KVServerConnector disabled" not in run.log, run.log[-3000:]
        assert f"2 {HYBRID_LINE}: full, sliding/96" in run.log or f"2 {HYBRID_LINE}: sliding/96, full" in run.log


def test_sliding_global_reuse_matches_recompute(gemma3_runs: Runs) -> None:
    ref = gemma3_runs.ref.requests
    assert len({tuple(r.token_ids) for r in ref}) == 2  # the outputs depend on the prompt
    assert gemma3_runs.store.requests[0].token_ids == ref[0].token_ids
    got = gemma3_runs.reuse.requests[0]
    assert got.connector_loaded_tokens == 512  # both groups, from the server, in another process
    assert got.token_ids == ref[1].token_ids


def test_sliding_global_failed_load_recomputes(gemma3_runs: Runs) -> None:
    got = gemma3_runs.corrupt.requests[0]
    params = (got.kv_transfer_params or {})["kvserver"]
    assert params["load_failed"] is True
    assert got.connector_loaded_tokens == 0
    assert got.token_ids == gemma3_runs.ref.requests[1].token_ids
