"""A sliding-window model in real vLLM (CPU): a tiny random-weight Mistral whose every layer has a
96-token window (one KV cache group, vLLM's SlidingWindowSpec; vLLM frees the blocks that fall out
of the window). The connector stores one window snapshot per store end (kvprotocol._geometry) and
loads only the window the first computed token attends to. Greedy tokens equal a run without the
connector; a prefix whose window was never stored misses instead of being bridged."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtestkit.serverproc import ServerFactory
from kvtestkit.engines.tiny_model import random_prompt
from vllm_cases import confirmed, kv_config
from kvtestkit.engines.vllm_harness import VLLM_PYTHON, build_variant, prompt, run_engine

pytestmark = pytest.mark.vllm_engine

P1 = random_prompt(600, seed=41)  # 2 chunks of 256: a snapshot of the window ending at 512
P2 = random_prompt(512, seed=42)  # exactly 2 chunks: vLLM computes the last token again (from 511)
P3 = P1[:300] + random_prompt(100, seed=43)  # shares 256 tokens with P1, but no window ends at 256


@pytest.fixture(scope="module")
def sw_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} missing: build it with scripts/make-vllm-env.sh")
    return build_variant(tmp_path_factory.mktemp("tiny-mistral-sw") / "model", "build_mistral_sw")


def test_sliding_window_reuse_matches_recompute(sw_dir: Path, kvserver_factory: ServerFactory) -> None:
    stored = [[prompt(P1)], [prompt(P2)]]
    ref = run_engine(sw_dir, stored + [[prompt(P3)]], max_tokens=8, llm_kwargs={"enable_prefix_caching": False})
    server = kvserver_factory()
    a = run_engine(sw_dir, stored, max_tokens=8, kv_transfer_config=kv_config(server.url))
    assert "KVServerConnector disabled" not in a.log, a.log[-3000:]
    assert all(confirmed(r.kv_transfer_params, 512) for r in a.requests)
    b = run_engine(sw_dir, stored + [[prompt(P3)]], max_tokens=8, kv_transfer_config=kv_config(server.url))
    assert [r.token_ids for r in a.requests] == [r.token_ids for r in ref.requests[:2]]
    assert [r.token_ids for r in b.requests] == [r.token_ids for r in ref.requests]
    assert [r.connector_loaded_tokens for r in b.requests] == [512, 511, 0]


P4 = random_prompt(700, seed=44)
P5 = P4[:520] + random_prompt(80, seed=45)  # shares 2 chunks with P4


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} missing: build it with scripts/make-vllm-env.sh")
    return build_variant(tmp_path_factory.mktemp("tiny-gemma3") / "model", "build_gemma3")


def test_mixed_windows_promoted_to_full_attention(gemma3_dir: Path, kvserver_factory: ServerFactory) -> None:
    """Gemma-3-style (a windowed layer, then a global one): with the hybrid KV cache manager turned off
    (the connector supports it; tests/vllm/test_vllm_hybrid.py runs it on), vLLM promotes the windowed
    layer to full attention (one group, every block kept), so the connector caches it as full
    attention; a prefix shared with another prompt is reused too."""
    batches = [[prompt(P4)], [prompt(P5)]]
    ref = run_engine(gemma3_dir, batches, max_tokens=8, llm_kwargs={"enable_prefix_caching": False})
    assert len({tuple(r.token_ids) for r in ref.requests}) == 2  # the outputs depend on the prompt
    server = kvserver_factory()
    hma_off = {"disable_hybrid_kv_cache_manager": True}
    a = run_engine(gemma3_dir, batches[:1], max_tokens=8, kv_transfer_config=kv_config(server.url), llm_kwargs=hma_off)
    assert "KVServerConnector disabled" not in a.log, a.log[-3000:]
    assert "KV cache groups (hybrid manager)" not in a.log  # one group: today's path
    b = run_engine(gemma3_dir, batches[1:], max_tokens=8, kv_transfer_config=kv_config(server.url), llm_kwargs=hma_off)
    # (failed twice in full-suite runs, once in CI, never alone: A decoding pad tokens after a correct
    # first token; the message carries what tells a vLLM-side flake from a connector fault)
    assert a.requests[0].token_ids == ref.requests[0].token_ids, (a.requests[0], a.log[-4000:])
    assert b.requests[0].token_ids == ref.requests[1].token_ids, (b.requests[0], b.log[-4000:])
    assert b.requests[0].connector_loaded_tokens == 512  # the 2 chunks P5 shares with P4, from the server
