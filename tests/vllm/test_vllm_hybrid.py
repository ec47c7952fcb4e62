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
from test_vllm_tp import _remove_vllm_dist_segments  # noqa: F401 - autouse: cleans up after the TP run
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


def test_sliding_window_saves_finish_within_their_step(gemma3_runs: Runs) -> None:
    """The hybrid manager frees a sliding block once it leaves the window: a save still running in
    the background then could read a block given to another request. So saves finish within the
    step, and by the end of the request everything it stored is confirmed (never a part)."""
    run = gemma3_runs.store
    assert run.log.count("sliding-window or state groups: saves run within the step") == 2, run.log[-3000:]
    assert run.requests[0].kv_transfer_params["kvserver"]["stored_tokens"] == 512


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


def test_sliding_global_tp2_ranks_reuse_their_groups(
    tmp_path_factory: pytest.TempPathFactory, kvserver_factory: ServerFactory, tmp_path
) -> None:
    """The same model with TP=2 (one worker process per rank, each with half the KV heads of both
    groups): one engine stores P_STORE, then its next request loads the shared 512 tokens from the
    server (vLLM's prefix cache off, so nothing else can supply them), and the tokens equal a TP=2
    run without the connector."""
    from test_vllm_tp import TP, tp_env

    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} missing: build it with scripts/make-vllm-env.sh")
    model = build_variant(tmp_path_factory.mktemp("tiny-gemma3-tp") / "model", "build_gemma3")
    env = tp_env(tmp_path)
    batches = [[prompt(P_STORE)], [prompt(P_REUSE)]]
    no_cache = {**TP, "enable_prefix_caching": False}
    ref = run_engine(model, batches, env=env, llm_kwargs=no_cache)
    server = kvserver_factory()
    run = run_engine(model, batches, env=env, llm_kwargs=no_cache, kv_transfer_config=kv_config(server.url))
    assert run.log.count(f"2 {HYBRID_LINE}") >= 3, run.log[-3000:]  # the scheduler and both ranks' workers
    assert "KVServerConnector disabled" not in run.log, run.log[-3000:]
    assert [r.connector_loaded_tokens for r in run.requests] == [0, 512]
    assert [r.token_ids for r in run.requests] == [r.token_ids for r in ref.requests]


Q_STORE = random_prompt(640, seed=48)
Q_REUSE = Q_STORE[:600] + random_prompt(40, seed=49)  # shares 2 hybrid blocks of 288 with Q_STORE
QWEN3_NEXT = {"dtype": "bfloat16", "enable_prefix_caching": True}  # vLLM CPU's GDN runs in bf16 only
Q_CHUNK = 288  # vLLM's block for this hybrid (one attention page holds a GDN state): the chunk size


@dataclass(frozen=True)
class GdnRuns:
    ref: EngineRun  # no connector: Q_STORE, then Q_REUSE on vLLM's own prefix cache
    store: EngineRun  # the same two prompts with the connector (Q_REUSE hits vLLM's own cache)
    reuse: EngineRun  # another engine process: Q_REUSE, its prefix and GDN state loaded
    corrupt: EngineRun  # the same, its load's first chunk overwritten with garbage and reported failed


@pytest.fixture(scope="module")
def qwen3_next_runs(tmp_path_factory: pytest.TempPathFactory, kvserver_factory: ServerFactory) -> GdnRuns:
    """A gated-delta-net hybrid (tiny random Qwen3-Next). vLLM's own prefix cache is on everywhere:
    a GDN scan depends on where its chunks start, so tokens are compared between runs with the same
    schedule: a hit at 576 tokens (vLLM's own in `ref`, a load in `reuse`), then tokens 576..640."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} missing: build it with scripts/make-vllm-env.sh")
    model = build_variant(tmp_path_factory.mktemp("tiny-qwen3-next") / "model", "build_qwen3_next")
    batches = [[prompt(Q_STORE)], [prompt(Q_REUSE)]]
    probe = {"state_digests": True}
    ref = run_engine(model, batches, llm_kwargs=QWEN3_NEXT, extra_spec=probe)
    server = kvserver_factory("--chunk-size", str(Q_CHUNK))
    kv = kv_config(server.url, chunk_size=Q_CHUNK)
    store = run_engine(model, batches, llm_kwargs=QWEN3_NEXT, kv_transfer_config=kv)
    reuse = run_engine(model, [[prompt(Q_REUSE)]], llm_kwargs=QWEN3_NEXT, kv_transfer_config=kv, extra_spec=probe)
    bad = kv_config(server.url, chunk_size=Q_CHUNK, debug_fail_load_chunks=[0])
    corrupt = run_engine(model, [[prompt(Q_REUSE)]], llm_kwargs=QWEN3_NEXT, kv_transfer_config=bad, extra_spec=probe)
    return GdnRuns(ref, store, reuse, corrupt)


def test_gdn_hybrid_stores_its_states_within_the_step(qwen3_next_runs: GdnRuns) -> None:
    """Without SupportsHMA vLLM refused to start such a model with the connector configured. Now
    both groups are object groups: the attention group's chunks and, at each store's end, the GDN
    state vLLM keeps at that boundary. vLLM frees a state block two steps after writing it, so saves
    run within the step; everything the prompt stored is confirmed when it finishes."""
    run = qwen3_next_runs.store
    assert "KVServerConnector disabled" not in run.log, run.log[-3000:]
    assert f"2 {HYBRID_LINE}: state, full" in run.log or f"2 {HYBRID_LINE}: full, state" in run.log
    assert run.log.count("sliding-window or state groups: saves run within the step") == 2
    assert run.requests[0].kv_transfer_params["kvserver"]["stored_tokens"] == 576
    assert [r.token_ids for r in run.requests] == [r.token_ids for r in qwen3_next_runs.ref.requests]


def test_gdn_hybrid_reuses_prefix_and_state_across_engines(qwen3_next_runs: GdnRuns) -> None:
    """Another engine process loads 576 tokens: the attention blocks and the GDN state after token
    576. The state vLLM then holds in its own prefix cache for that boundary is byte for byte the one
    the reference engine computed itself (this tiny random model's greedy tokens barely depend on
    the GDN state: loading the wrong state slot left them equal, the digests caught it)."""
    runs = qwen3_next_runs
    reused = runs.reuse.requests[0]
    assert reused.connector_loaded_tokens == 576, runs.reuse.log[-3000:]
    assert runs.ref.requests[1].num_cached_tokens == 576  # the reference hit vLLM's own cache there
    assert reused.token_ids == runs.ref.requests[1].token_ids
    assert runs.ref.state_digests is not None and runs.reuse.state_digests is not None
    assert runs.reuse.state_digests[576] == runs.ref.state_digests[576]


def test_gdn_hybrid_failed_load_recomputes(qwen3_next_runs: GdnRuns) -> None:
    """A load whose first chunk is garbage and reported failed: vLLM recomputes the request from its
    first token (several KV cache groups: the whole request), so the state it caches at 576 is its
    own again, equal to the reference's, and so are the tokens."""
    runs = qwen3_next_runs
    got = runs.corrupt.requests[0]
    assert got.kv_transfer_params["kvserver"]["load_failed"] is True
    assert got.connector_loaded_tokens == 0
    assert got.token_ids == runs.ref.requests[1].token_ids
    assert runs.corrupt.state_digests is not None and runs.ref.state_digests is not None
    assert runs.corrupt.state_digests[576] == runs.ref.state_digests[576]
