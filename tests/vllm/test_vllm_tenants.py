"""Tenants through real vLLM engines: the connector presents the tenant token from
kv_connector_extra_config (`api_token` or `token_file`), and the server keeps tenants apart.

Engine A (tenant alice) stores a prompt; engine B (tenant bob, same prompt, same cache_salt: none)
loads nothing; engine C (alice again) loads the prefix. Every output equals the recompute reference.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvtestkit.serverproc import KVSERVER_BIN, ServerFactory
from vllm_cases import MAX_TOKENS, P_LONG, kv_config
from kvtestkit.engines.vllm_harness import EngineRun, prompt, run_engine

pytestmark = pytest.mark.vllm_engine
CHUNK = 256


def _tenant(tenants: Path, name: str, token_file: Path | None = None) -> str:
    cmd = [str(KVSERVER_BIN), "tenant", "add", name, "--tenants-file", str(tenants)]
    if token_file is not None:
        cmd += ["--token-file", str(token_file)]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()


def test_engines_of_another_tenant_never_load_its_kv(
    model_dir: Path, kvserver_factory: ServerFactory, reference: EngineRun, tmp_path: Path
) -> None:
    tenants = tmp_path / "tenants.json"
    alice = _tenant(tenants, "alice")
    bob_file = tmp_path / "bob.token"
    _tenant(tenants, "bob", bob_file)
    server = kvserver_factory("--tenants-file", str(tenants))
    batches = [[prompt(P_LONG)]]
    a = run_engine(model_dir, batches, max_tokens=MAX_TOKENS, kv_transfer_config=kv_config(server.url, api_token=alice))
    b = run_engine(
        model_dir, batches, max_tokens=MAX_TOKENS, kv_transfer_config=kv_config(server.url, token_file=str(bob_file))
    )
    c = run_engine(model_dir, batches, max_tokens=MAX_TOKENS, kv_transfer_config=kv_config(server.url, api_token=alice))
    want = reference.batches[0].requests[0].token_ids
    assert a.batches[0].requests[0].token_ids == want
    assert b.batches[0].requests[0].connector_loaded_tokens == 0  # bob never sees alice's KV
    assert b.batches[0].requests[0].token_ids == want
    assert c.batches[0].requests[0].connector_loaded_tokens == 2 * CHUNK  # alice's own engines share
    assert c.batches[0].requests[0].token_ids == want
