"""Cache keys carry what changes the KV: LoRA adapters (real vLLM, real adapters), the model's weights.

Every output is compared with a no-connector baseline of the same prompt and adapter.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtestkit.serverproc import ServerFactory
from vllm_cases import MAX_TOKENS, P_LONG, confirmed, kv_config
from kvtestkit.engines.vllm_harness import EngineRun, build_adapter, prompt, run_engine

pytestmark = pytest.mark.vllm_engine

LORA = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}


def _kvs(run: EngineRun) -> list[dict]:
    return [r.kv_transfer_params["kvserver"] for r in run.requests]


def test_lora_adapters_never_share_kv_and_reuse_their_own(
    model_dir: Path, kvserver_factory: ServerFactory, reference: EngineRun, tmp_path: Path
) -> None:
    a = ("adapter-a", 1, str(build_adapter(tmp_path / "lora-a", model_dir, seed=1)))
    b = ("adapter-b", 2, str(build_adapter(tmp_path / "lora-b", model_dir, seed=2)))
    base = run_engine(
        model_dir,
        [[prompt(P_LONG, lora=a)], [prompt(P_LONG, lora=b)]],
        max_tokens=MAX_TOKENS,
        llm_kwargs={**LORA, "enable_prefix_caching": False},
    )
    want_a, want_b = (r.token_ids for r in base.requests)
    assert want_a != want_b != reference.batches[0].requests[0].token_ids  # the adapters change the output

    server = kvserver_factory()
    kv = kv_config(server.url)
    first = run_engine(
        model_dir,
        [[prompt(P_LONG, lora=a)], [prompt(P_LONG, lora=b)]],
        max_tokens=MAX_TOKENS,
        kv_transfer_config=kv,
        llm_kwargs={**LORA, "enable_prefix_caching": False},
    )
    assert [r.token_ids for r in first.requests] == [want_a, want_b]
    assert [k["hit_tokens"] for k in _kvs(first)] == [0, 0]  # B never sees A's chunks
    assert all(0 <= k["stored_tokens"] <= 512 for k in _kvs(first))  # confirmed by finish (async saves)

    second = run_engine(
        model_dir,
        [[prompt(P_LONG, lora=b)], [prompt(P_LONG, lora=a)], [prompt(P_LONG)]],
        max_tokens=MAX_TOKENS,
        kv_transfer_config=kv,
        llm_kwargs={**LORA, "enable_prefix_caching": False},
    )
    got_b, got_a, plain = second.requests
    assert got_b.connector_loaded_tokens == 512 and got_b.token_ids == want_b  # same adapter, new process
    assert got_a.connector_loaded_tokens == 512 and got_a.token_ids == want_a
    assert plain.kv_transfer_params["kvserver"]["hit_tokens"] == 0  # no adapter: neither one's KV
    assert plain.token_ids == reference.batches[0].requests[0].token_ids


def test_weights_updated_in_place_are_another_model(kvserver_factory: ServerFactory, tmp_path: Path) -> None:
    """Same path, same served name, new weights (a persistent cache would otherwise serve stale KV)."""
    from kvtestkit.engines.vllm_harness import build_model

    path = tmp_path / "model"
    build_model(path, {"seed": 1})
    server = kvserver_factory()
    kv = kv_config(server.url)
    old = run_engine(path, [[prompt(P_LONG)]], max_tokens=MAX_TOKENS, kv_transfer_config=kv)
    assert confirmed(old.requests[0].kv_transfer_params, 512)
    build_model(path, {"seed": 2})  # overwrites the safetensors file: same names, sizes and header
    new = run_engine(path, [[prompt(P_LONG)]], max_tokens=MAX_TOKENS, kv_transfer_config=kv)
    r = new.requests[0]
    assert r.kv_transfer_params["kvserver"]["hit_tokens"] == 0 and r.connector_loaded_tokens == 0
    assert r.token_ids != old.requests[0].token_ids  # the weights really changed
    assert _model_key(new) != _model_key(old)


def _model_key(run: EngineRun) -> str:
    keys = {line.split("model key ", 1)[1].split()[0] for line in run.log.splitlines() if "model key " in line}
    assert len(keys) == 1, keys  # the scheduler's and the worker's agree
    return keys.pop()
