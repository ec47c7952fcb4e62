"""KVServerConnector in real vLLM engines: engine A stores, a separate engine B reuses.

Each engine is its own process, so a hit in B can only come from the kvserver. Outputs are
compared token for token with the plain-recompute reference run (greedy, fp32).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtestkit.serverproc import ServerFactory
from vllm_cases import (
    MAX_TOKENS,
    P_GEN,
    P_LONG,
    P_SALTED,
    P_SHARED,
    P_SHARED_ASKS,
    P_TURN1,
    TURN2_TEXT,
    confirmed,
    kv_config,
)
from kvtestkit.engines.vllm_harness import EngineRun, prompt, run_engine

pytestmark = pytest.mark.vllm_engine

CHUNK = 256


@dataclass
class TwoEngines:
    a: EngineRun
    b: EngineRun


@pytest.fixture(scope="module")
def two_engines(model_dir: Path, kvserver_factory: ServerFactory) -> TwoEngines:
    server = kvserver_factory()
    # A (the default save_policy "all": storing generated tokens too): batches 0 P_LONG, 1 P_TURN1
    # (turn 1 of a chat), 2 P_SALTED under tenant-a, 3 P_GEN (turn 1 of another chat), 4 P_SHARED.
    a = run_engine(
        model_dir,
        [[prompt(P_LONG)], [prompt(P_TURN1)], [prompt(P_SALTED, "tenant-a")], [prompt(P_GEN)], [prompt(P_SHARED)]],
        max_tokens=MAX_TOKENS,
        kv_transfer_config=kv_config(server.url),
    )
    turn1_out = a.batches[1].requests[0].token_ids
    gen_out = a.batches[3].requests[0].token_ids
    # B: 0 P_LONG again, 1 turn 2 of the chat, 2 P_SALTED under tenant-b, 3 P_SALTED under tenant-a,
    # 4 turn 2 of the P_GEN chat, 5 four requests on P_SHARED's first two chunks, together.
    b = run_engine(
        model_dir,
        [
            [prompt(P_LONG)],
            [prompt(P_TURN1 + turn1_out + TURN2_TEXT)],
            [prompt(P_SALTED, "tenant-b")],
            [prompt(P_SALTED, "tenant-a")],
            [prompt(P_GEN + gen_out + TURN2_TEXT)],
            [prompt(p) for p in P_SHARED_ASKS],
        ],
        max_tokens=MAX_TOKENS,
        # B copies with the CUDA copier's code (torch index ops, staging, the streams interface) on
        # its CPU KV: every reuse below then also proves that path inside a real engine
        kv_transfer_config=kv_config(server.url, copy_backend="torch"),
    )
    return TwoEngines(a, b)


def test_storing_engine_output_matches_reference(two_engines: TwoEngines, reference: EngineRun) -> None:
    a, ref = two_engines.a, reference
    assert a.batches[0].requests[0].token_ids == ref.batches[0].requests[0].token_ids
    assert a.batches[1].requests[0].token_ids == ref.batches[1].requests[0].token_ids
    assert a.batches[2].requests[0].token_ids == ref.batches[3].requests[0].token_ids
    # A new server holds nothing: A computed everything itself.
    assert all(r.connector_loaded_tokens == 0 for r in a.requests)
    assert confirmed(a.batches[0].requests[0].kv_transfer_params, 2 * CHUNK)


def test_second_engine_loads_prefix_and_matches_reference(two_engines: TwoEngines, reference: EngineRun) -> None:
    r = two_engines.b.batches[0].requests[0]
    assert len(P_LONG) == 700
    assert r.connector_loaded_tokens == 2 * CHUNK  # both full chunks; the 188-token tail is recomputed
    assert r.num_cached_tokens == 2 * CHUNK
    assert r.token_ids == reference.batches[0].requests[0].token_ids


def test_multi_turn_reuses_turn_one_chunks(two_engines: TwoEngines, reference: EngineRun) -> None:
    a, b = two_engines.a, two_engines.b
    # Turn 1 came out the same as in the reference, so turn 2's prompt is the same too.
    assert a.batches[1].requests[0].token_ids == reference.batches[1].requests[0].token_ids
    r = b.batches[1].requests[0]
    assert r.prompt_len == len(P_TURN1) + MAX_TOKENS + len(TURN2_TEXT)
    # turn 1's full chunks and its tail: every token whose KV turn 1 computed (all but the last
    # generated one), so turn 2 computes only its new text (and that one token)
    assert r.connector_loaded_tokens == len(P_TURN1) + MAX_TOKENS - 1
    assert r.token_ids == reference.batches[2].requests[0].token_ids


def test_save_policy_all_stores_generated_tokens(two_engines: TwoEngines, reference: EngineRun) -> None:
    a, b = two_engines.a, two_engines.b
    assert a.batches[3].requests[0].token_ids == reference.batches[4].requests[0].token_ids
    # Chunk 1 (tokens 256-511) holds 250 prompt and 6 generated tokens: stored under "all" only. Its
    # save starts two steps before the request ends and runs on (async saves): stored_tokens counts
    # only what was confirmed when the request finished (under load even chunk 0 may still be on its
    # way). B's load of both chunks below is the proof both were stored.
    assert confirmed(a.batches[3].requests[0].kv_transfer_params, 2 * CHUNK)
    r = b.batches[4].requests[0]
    assert r.connector_loaded_tokens == len(P_GEN) + MAX_TOKENS - 1  # both chunks, and the 1-token tail
    assert r.token_ids == reference.batches[5].requests[0].token_ids


def test_cache_salt_isolates_tenants(two_engines: TwoEngines, reference: EngineRun) -> None:
    other, same = two_engines.b.batches[2].requests[0], two_engines.b.batches[3].requests[0]
    assert other.connector_loaded_tokens == 0  # tenant-b never sees tenant-a's KV
    # two chunks and the prompt's own tail (saved beside the answer's under "all"): all but the last token
    assert same.connector_loaded_tokens == same.prompt_len - 1 > 2 * CHUNK
    want = reference.batches[3].requests[0].token_ids
    assert other.token_ids == want and same.token_ids == want


def test_requests_on_one_stored_prefix_share_one_load(two_engines: TwoEngines, reference: EngineRun) -> None:
    """Four requests arrive together, each needing the same two stored chunks. One loads them from
    the server; the other three wait for that one load, then find the chunks in vLLM's own prefix
    cache. Without share_loads each loads its own copy, one after the other on the loader thread
    (this test then sees 4 loads of 512 tokens)."""
    asks = two_engines.b.batches[5].requests
    assert [r.connector_loaded_tokens for r in asks].count(2 * CHUNK) == 1
    assert sum(r.connector_loaded_tokens for r in asks) == 2 * CHUNK
    assert all(r.num_cached_tokens == 2 * CHUNK for r in asks)  # every request got the prefix
    assert [r.token_ids for r in asks] == [r.token_ids for r in reference.batches[6].requests]


def test_scheduler_and_worker_compute_the_same_layout(two_engines: TwoEngines) -> None:
    for run in (two_engines.a, two_engines.b):
        config_fps = set(re.findall(r"KVServerConnector (?:scheduler|worker): .*config layout ([0-9a-f]{16})", run.log))
        tensor_fps = set(re.findall(r"registered \d+ layers, tensor layout ([0-9a-f]{16})", run.log))
        assert len(config_fps) == 1 and config_fps == tensor_fps, run.log[-3000:]
        # the CPU attention ISA packs each block, so it is part of the fingerprint (never "unknown")
        isas = set(re.findall(r"config layout [0-9a-f]{16} \(backend CPU_ATTN/(\w+)\)", run.log))
        assert len(isas) == 1 and isas <= {"vec", "vec16", "amx", "neon", "vsx", "vxe", "rvv"}, run.log[-3000:]
    copiers = [
        set(re.findall(r"tensor layout [0-9a-f]{16}, copier ([\w-]+)", r.log)) for r in (two_engines.a, two_engines.b)
    ]
    assert copiers == [{"host"}, {"torch-cpu"}]
