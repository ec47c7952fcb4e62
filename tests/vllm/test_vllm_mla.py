"""MLA in real vLLM (CPU): a tiny random-weight DeepSeek-V2 (kv_lora_rank 512 + rope 64 = the 576-wide
latent the CPU MLA kernel compiles; vLLM forces block size 16 and turns off its own prefix cache
and chunked prefill for MLA on CPU). Engine A stores, a separate engine B loads the prefix; greedy
tokens equal a run without the connector. The layout is `shared` (one object per chunk for every
tensor-parallel rank, tests/kvconnector/test_shared_rank_objects.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvprotocol import Client
from kvtestkit.serverproc import ServerFactory
from test_vllm_tp import TP, _remove_vllm_dist_segments, tp_env  # noqa: F401 - the fixture cleans up TP runs
from kvtestkit.engines.tiny_model import random_prompt
from vllm_cases import confirmed, kv_config
from kvtestkit.engines.vllm_harness import VLLM_PYTHON, build_variant, prompt, run_engine

pytestmark = pytest.mark.vllm_engine

# vLLM picks its AMX MLA backend on CPUs with AMX tiles; that backend is bf16-only and fails to load
# this fp32 model (seen on an AMX CI host). The reference CPU backend runs on every CPU, so pin it.
MLA = {"attention_backend": "CPU_MLA"}
MLA_TP = {**TP, **MLA}

P1 = random_prompt(600, seed=31)
P2 = random_prompt(530, seed=32)


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} missing: build it with scripts/make-vllm-env.sh")
    return build_variant(tmp_path_factory.mktemp("tiny-dsv2") / "model", "build_deepseek_v2")


def test_mla_prefix_reuse_matches_recompute(mla_dir: Path, kvserver_factory: ServerFactory) -> None:
    batches = [[prompt(P1)], [prompt(P2)]]
    ref = run_engine(mla_dir, batches, max_tokens=8, llm_kwargs=MLA)
    server = kvserver_factory()
    a = run_engine(mla_dir, batches, max_tokens=8, kv_transfer_config=kv_config(server.url), llm_kwargs=MLA)
    assert "KVServerConnector disabled" not in a.log, a.log[-3000:]
    assert "tensor layout" in a.log  # the worker registered its latent cache
    b = run_engine(mla_dir, batches, max_tokens=8, kv_transfer_config=kv_config(server.url), llm_kwargs=MLA)
    for run in (a, b):
        assert [r.token_ids for r in run.requests] == [r.token_ids for r in ref.requests]
    assert [r.connector_loaded_tokens for r in a.requests] == [0, 0]
    assert all(confirmed(r.kv_transfer_params, 512) for r in a.requests)
    # B takes both chunks of each prompt from the server (600 and 530 tokens hold 2 chunks of 256)
    assert [r.connector_loaded_tokens for r in b.requests] == [512, 512]


@pytest.mark.timeout(1500)
def test_mla_tp2_ranks_share_one_object_per_chunk(
    mla_dir: Path, kvserver_factory: ServerFactory, tmp_path: Path
) -> None:
    """TP=2: both ranks hold the same latent cache; the server keeps one object per chunk (not two),
    both ranks load it, and the output equals a TP=2 recompute."""
    env = tp_env(tmp_path)
    ref = run_engine(mla_dir, [[prompt(P1)]], max_tokens=8, env=env, llm_kwargs=MLA_TP)
    server = kvserver_factory()
    a = run_engine(
        mla_dir, [[prompt(P1)]], max_tokens=8, kv_transfer_config=kv_config(server.url), llm_kwargs=MLA_TP, env=env
    )
    assert confirmed(a.requests[0].kv_transfer_params, 512)
    with Client(server.url) as c:
        d = c.call("describe").result
    assert d["l1"]["objects"] == 2  # 2 chunks x 1 shared object, where a per-rank layout keeps 4
    b = run_engine(
        mla_dir, [[prompt(P1)]], max_tokens=8, kv_transfer_config=kv_config(server.url), llm_kwargs=MLA_TP, env=env
    )
    r = b.requests[0]
    assert r.kv_transfer_params["kvserver"]["load_failed"] is False and r.connector_loaded_tokens == 512
    assert r.token_ids == ref.requests[0].token_ids == a.requests[0].token_ids
    with Client(server.url) as c:
        d = c.call("describe").result
    # two engines x two ranks registered; their entries expire once the processes exited (periodic sweep)
    assert len([e for e in d["engines"] if e["world_size"] == 2]) + d["engines_expired"] == 4
    assert d["sessions"] == 0 and d["l1"]["leased"] == 0 and d["counters"]["broken_reads"] == 0
