"""A full cache is not a failing server: the connector stores what fits and keeps saving."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvprotocol import Client
from kvtestkit.serverproc import ServerFactory
from kvtestkit.engines.tiny_model import TINY, random_prompt
from vllm_cases import MAX_TOKENS, P_LONG, confirmed, kv_config
from kvtestkit.engines.vllm_harness import EngineRun, prompt, run_engine

pytestmark = pytest.mark.vllm_engine

OBJECT_BYTES = TINY.kv_bytes_per_token_fp32 * 256  # one chunk of the tiny model: 256 KiB


def test_full_cache_stores_what_fits_and_keeps_saving(
    model_dir: Path, kvserver_factory: ServerFactory, reference: EngineRun
) -> None:
    """An arena with room for one object: P_LONG's 2-chunk save stores one chunk (NO_SPACE for the
    other, both being written at once). That is a partial save, not a server failure: with a 60 s
    breaker, the next request's save would otherwise be skipped; here it is stored."""
    server = kvserver_factory("--l1-size-gb", str(1.6 * OBJECT_BYTES / (1 << 30)))
    short = random_prompt(300, seed=21)  # one full chunk
    kv = kv_config(server.url, retry_after_s=60.0)
    run = run_engine(
        model_dir,
        [[prompt(P_LONG)], [prompt(short)]],
        max_tokens=MAX_TOKENS,
        kv_transfer_config=kv,
        extra_spec={"connector_stats": True},
    )
    full, after = run.batches
    assert full.requests[0].token_ids == reference.batches[0].requests[0].token_ids
    assert full.connector_stats is not None and after.connector_stats is not None
    assert full.connector_stats["partial_saves"] == 1 and full.connector_stats["saved_chunks"] == 1
    assert full.connector_stats["save_errors"] == 0
    assert after.connector_stats["skipped_server_down"] == 0
    assert after.connector_stats["saved_chunks"] == 1 and after.connector_stats["partial_saves"] == 0
    # stored_tokens counts what was confirmed when the request finished; its save may still run then
    # (asynchronous saves): the batch's saved_chunks above, read after the save ended, proves the store
    assert confirmed(after.requests[0].kv_transfer_params, 256)
    with Client(server.url) as c:
        counters = c.call("describe").result["counters"]
    assert counters["stored_objects"] == 2 and counters["no_space"] >= 1
