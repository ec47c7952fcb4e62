"""KVServerConnector when things go wrong: failed loads are recomputed, a dead server is a miss."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserver_proc import ServerFactory
from vllm_cases import MAX_TOKENS, P_GEN, P_LONG, kv_config
from vllm_harness import EngineRun, prompt, run_engine

pytestmark = pytest.mark.vllm_engine


def test_failed_load_is_recomputed(model_dir: Path, kvserver_factory: ServerFactory,
                                   reference: EngineRun) -> None:
    server = kvserver_factory()
    run_engine(model_dir, [[prompt(P_LONG)]], max_tokens=MAX_TOKENS, kv_transfer_config=kv_config(server.url))
    # Fault injection: after the load, chunk 1's blocks are overwritten with garbage and reported as
    # failed. Unless vLLM recomputes them, the output cannot match the reference.
    kv = kv_config(server.url, policy="recompute", debug_fail_load_chunks=[1])
    run = run_engine(model_dir, [[prompt(P_LONG)]], max_tokens=MAX_TOKENS, kv_transfer_config=kv)
    r = run.requests[0]
    assert r.kv_transfer_params["kvserver"]["load_failed"] is True
    assert r.connector_loaded_tokens == 256  # chunk 0 loaded; chunk 1 on was recomputed
    assert r.token_ids == reference.batches[0].requests[0].token_ids
    assert "load of 8 blocks failed" in run.log


def test_server_killed_between_engines(model_dir: Path, kvserver_factory: ServerFactory,
                                       reference: EngineRun) -> None:
    server = kvserver_factory()
    kv = kv_config(server.url, timeout_s=1.0)
    a = run_engine(model_dir, [[prompt(P_LONG)], [prompt(P_GEN)]], max_tokens=MAX_TOKENS, kv_transfer_config=kv)
    assert a.requests[0].kv_transfer_params["kvserver"]["stored_tokens"] == 512
    # save_policy "prompt" (the default) stores only chunks made of prompt tokens
    assert a.requests[1].kv_transfer_params["kvserver"]["stored_tokens"] == 256
    server.kill()
    b = run_engine(model_dir, [[prompt(P_LONG)], [prompt(P_LONG[:600])]], max_tokens=MAX_TOKENS,
                   kv_transfer_config=kv)
    want = reference.batches[0].requests[0].token_ids
    assert b.requests[0].token_ids == want
    assert all(r.connector_loaded_tokens == 0 for r in b.requests)
    for r in b.requests:
        assert r.kv_transfer_params["kvserver"]["hit_tokens"] == 0
        assert r.kv_transfer_params["kvserver"]["stored_tokens"] == 0  # the store failed, and it knows
