"""plan_loads: the connector loads a hit only when its measured load throughput beats the engine's
measured prefill rate; a load made slow on purpose teaches it to decline, a fast one to accept."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtestkit.serverproc import ServerFactory
from vllm_cases import MAX_TOKENS, P_LONG, P_TURN1, kv_config
from kvtestkit.engines.vllm_harness import EngineRun, prompt, run_engine

pytestmark = pytest.mark.vllm_engine


def _second_engine(model_dir: Path, url: str, delay_s: float) -> EngineRun:
    kv = kv_config(url, plan_loads=True, debug_load_delay_s=delay_s)
    return run_engine(
        model_dir,
        [[prompt(P_LONG)], [prompt(P_TURN1)]],
        max_tokens=MAX_TOKENS,
        kv_transfer_config=kv,
        extra_spec={"connector_stats": True},
    )


def test_planner_declines_a_slow_load_and_accepts_a_fast_one(
    model_dir: Path, kvserver_factory: ServerFactory, reference: EngineRun
) -> None:
    server = kvserver_factory()
    run_engine(
        model_dir,
        [[prompt(P_LONG)], [prompt(P_TURN1)]],
        max_tokens=MAX_TOKENS,
        kv_transfer_config=kv_config(server.url),
    )
    # The first hit is loaded (nothing measured yet): 5 s for 512 tokens, ~100x slower than the tiny
    # model's prefill (1 s was only ~20x: a CI host busy enough to stretch the 88-token prefill step
    # past 0.17 s made loading look cheaper). The second hit is then declined and recomputed, with
    # the same output.
    slow = _second_engine(model_dir, server.url, delay_s=5.0)
    first, second = slow.batches
    assert first.requests[0].connector_loaded_tokens == 512
    assert second.connector_stats is not None and second.connector_stats["declined_hits"] == 1
    # P_TURN1's two chunks and its stored tail (this engine's workers have told its scheduler that the
    # server takes tails by now): all but the last token
    assert second.connector_stats["declined_tokens"] == len(P_TURN1) - 1
    assert second.requests[0].connector_loaded_tokens == 0
    assert second.requests[0].token_ids == reference.batches[1].requests[0].token_ids
    # Without the delay the same hit is loaded.
    fast = _second_engine(model_dir, server.url, delay_s=0.0)
    assert fast.batches[1].connector_stats is not None and fast.batches[1].connector_stats["declined_hits"] == 0
    assert fast.batches[1].requests[0].connector_loaded_tokens == len(P_TURN1) - 1
    assert fast.batches[1].requests[0].token_ids == reference.batches[1].requests[0].token_ids
