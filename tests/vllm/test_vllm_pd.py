"""Prefill/decode disaggregation through kvserver with real vLLM (bench/pd_proxy.py): a kv_producer
engine prefills each request (max_tokens=1) and stores its full chunks under a whole-request
reservation; a kv_consumer engine in another process loads them and computes only the tail."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvserver_proc import ServerFactory
from tiny_model import random_prompt
from vllm_cases import MAX_TOKENS, P_LONG
from vllm_harness import VLLM_PYTHON, engine_env

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from pd_proxy import Engine, kv_config, run_pd, run_single  # noqa: E402

pytestmark = pytest.mark.vllm_engine
CHUNK = 256
PROMPTS = [P_LONG, random_prompt(600, seed=21), random_prompt(300, seed=22)]


def test_prefill_then_decode_matches_one_engine_and_decode_computes_only_the_tail(
        model_dir: Path, kvserver_factory: ServerFactory, tmp_path: Path) -> None:
    server = kvserver_factory()
    env = engine_env(tmp_path / "vllm-cache")
    single = Engine(VLLM_PYTHON, model_dir, None, env, tmp_path / "single.log")
    try:
        base = run_single(single, PROMPTS, MAX_TOKENS)
    finally:
        single.close()
    prefill = Engine(VLLM_PYTHON, model_dir, kv_config(server.url, "kv_producer"), env, tmp_path / "prefill.log")
    decode = Engine(VLLM_PYTHON, model_dir, kv_config(server.url, "kv_consumer"), env, tmp_path / "decode.log")
    try:
        pd = run_pd(prefill, decode, PROMPTS, MAX_TOKENS, micro_batch=1)
        produced, consumed = prefill.stats(), decode.stats()
    finally:
        prefill.close()
        decode.close()
    for p, a, b in zip(PROMPTS, base["requests"], pd["requests"]):
        assert b["token_ids"] == a["token_ids"]  # greedy: identical to one engine doing both
        full = len(p) // CHUNK * CHUNK
        assert b["num_cached_tokens"] == full  # the decode engine computed only the tail after it
    full_chunks = sum(len(p) // CHUNK for p in PROMPTS)
    assert produced["saved_chunks"] == full_chunks
    assert produced.get("hit_tokens", 0) == 0 and produced.get("loaded_tokens", 0) == 0  # a producer never loads
    assert consumed["loaded_tokens"] == full_chunks * CHUNK
    assert consumed.get("saved_chunks", 0) == 0  # a consumer never stores
