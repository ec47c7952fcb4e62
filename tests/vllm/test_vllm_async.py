"""A failed load under async scheduling never lets a chunk computed over garbage blocks be saved.

Async scheduling plans step N+1 before step N's results (and its load errors) reach the scheduler.
vLLM's CPU platform turns async scheduling off ("not required on CPU", vllm/platforms/cpu.py
check_and_update_config); the engine runner turns it back on after that hook
(`force_async_scheduling`), and the test checks the engine really ran with it.

Scenario: chunks 0-1 of a 1100-token prompt are cached; the load of chunk 1 is made to fail
(garbage written into its blocks, reported failed); chunked prefill (256 tokens a step) computes
chunk 2 in the load's step and chunk 3 in the next step, which was planned before the failure was
known: both attended to the garbage. Neither may be stored. A fresh engine then loads all four
chunks and must generate exactly what a no-connector engine does.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvprotocol import Client
from kvtestkit.serverproc import ServerFactory
from kvtestkit.engines.tiny_model import random_prompt
from vllm_cases import MAX_TOKENS, kv_config
from kvtestkit.engines.vllm_harness import prompt, run_engine

pytestmark = pytest.mark.vllm_engine

P_ASYNC = random_prompt(1100, seed=21)
CHUNKED = {"enable_prefix_caching": False, "max_num_batched_tokens": 256, "enable_chunked_prefill": True}


@pytest.mark.parametrize("async_loads", [False, True], ids=["loads-in-step", "async-loads"])
def test_failed_load_under_async_scheduling_saves_nothing_computed_over_it(
    model_dir: Path, kvserver_factory: ServerFactory, async_loads: bool
) -> None:
    """With loads in the step, the steps planned before the failure was known compute over garbage and
    their saves must be dropped. With background loads (async_loads, none in the step) the request
    waits for its load, and vLLM learns of the failure before it computes anything over those blocks:
    nothing to drop, and the same end-to-end checks hold."""
    baseline = run_engine(
        model_dir, [[prompt(P_ASYNC)]], max_tokens=MAX_TOKENS, llm_kwargs={"enable_prefix_caching": False}
    )
    want = baseline.requests[0].token_ids
    server = kvserver_factory()
    failing = run_engine(
        model_dir,
        [[prompt(P_ASYNC[:600])], [prompt(P_ASYNC)]],
        max_tokens=MAX_TOKENS,
        kv_transfer_config=kv_config(
            server.url, debug_fail_load_chunks=[1], async_loads=async_loads, in_step_load_share=0
        ),
        llm_kwargs={**CHUNKED, "async_scheduling": True},
        extra_spec={"force_async_scheduling": True, "connector_stats": True},
    )
    assert failing.async_scheduling, "the engine did not run with async scheduling"
    seed, r = failing.requests
    # stored_tokens counts the saves confirmed when the request finished (asynchronous saves may still
    # be on their way); the batch's counters, read after the engine's background work ended, count all
    assert seed.kv_transfer_params["kvserver"]["stored_tokens"] in (0, 256, 512)
    assert failing.batches[0].connector_stats is not None
    # two chunks and two tails: the prompt's 88 tokens, and those with the answer (save_policy "all")
    assert failing.batches[0].connector_stats["saved_chunks"] == 4
    assert r.kv_transfer_params["kvserver"]["load_failed"] is True
    assert r.token_ids == want
    stats = failing.batches[1].connector_stats
    assert stats is not None and stats["load_errors"] == 1, stats
    if not async_loads:
        assert stats["unsafe_saves_dropped"] >= 1, stats
    with Client(server.url) as c:
        counters = c.call("describe").result["counters"]
    fresh = run_engine(
        model_dir,
        [[prompt(P_ASYNC)]],
        max_tokens=MAX_TOKENS,
        kv_transfer_config=kv_config(server.url),
        llm_kwargs={"enable_prefix_caching": False},
    )
    got = fresh.requests[0]
    assert got.token_ids == want, (counters, got.kv_transfer_params)
    assert got.connector_loaded_tokens in (512, 1024)  # chunks 2-3 stored only after being recomputed
