"""Prompts and connector configs shared by the real-vLLM tests (a plain module: test files import it)."""

from __future__ import annotations

from typing import Any

from kvtestkit.engines.tiny_model import random_prompt

# Prompts shared by the tests. Chunk size 256, block size 32: 700 tokens hold 2 full chunks.
P_LONG = random_prompt(700, seed=11)
P_TURN1 = random_prompt(600, seed=12)
TURN2_TEXT = random_prompt(200, seed=13)
P_SALTED = random_prompt(640, seed=14)
# 506 prompt tokens + 8 generated: the KV of token 511 exists after the 6th decode step, so chunk 1
# is full of prompt *and generated* tokens: stored only with save_policy "all".
P_GEN = random_prompt(506, seed=15)
# One stored 512-token prefix, then four requests that each need it, arriving together.
P_SHARED = random_prompt(576, seed=16)
P_SHARED_ASKS = [P_SHARED[:512] + random_prompt(64, seed=17 + i) for i in range(4)]
MAX_TOKENS = 8


def confirmed(kv_params: dict[str, Any], planned: int) -> bool:
    """Whether a request's `stored_tokens` fits a store of `planned` tokens.

    It counts what the server had confirmed when the request finished. Saves are asynchronous by
    default and may still be on their way then (MAX_TOKENS decode steps are a few milliseconds), so
    it is at most `planned`; the runner drains the engine's background work after each batch, and
    the tests prove the whole store by a later load or by the server's counters."""
    return 0 <= int(kv_params["kvserver"]["stored_tokens"]) <= planned


def kv_config(url: str, policy: str = "recompute", **extra: Any) -> dict[str, Any]:
    """The connector's defaults (async loads and saves), except the load planner: with the tiny model
    a load and a recompute of a chunk both take milliseconds, so which one the planner measures
    cheaper would depend on the host's load, and with it a test's expected hit. Tests of the planner
    turn it on (test_vllm_planner.py)."""
    extra.setdefault("plan_loads", False)
    return {
        "kv_connector": "KVServerConnector",
        "kv_connector_module_path": "kvconnector.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"kvserver_url": url, **extra},
    }
