"""Asynchronous loads (async_loads): a long load runs on the worker's loader thread while the other
requests keep decoding; the loading request waits in WAITING_FOR_REMOTE_KVS and its output is exact.
A short load runs inside the step instead, so vLLM never parks its request. Loads and saves run on
threads of their own, so a load never queues behind earlier saves. The tests of the background path
set in_step_load_share 0, so no load of theirs runs in the step."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtestkit.serverproc import ServerFactory, ServerProc
from vllm_cases import MAX_TOKENS, P_LONG, P_SALTED, P_TURN1, kv_config
from kvtestkit.engines.vllm_harness import EngineRun, prompt, run_engine

pytestmark = pytest.mark.vllm_engine


@pytest.fixture(scope="module")
def long_stored(model_dir: Path, kvserver_factory: ServerFactory) -> ServerProc:
    """A server holding P_LONG's two chunks, stored by an engine of its own. The tests that use it
    only read them (their failures are injected on the engine side), so one store serves them all."""
    server = kvserver_factory()
    run_engine(model_dir, [[prompt(P_LONG)]], max_tokens=MAX_TOKENS, kv_transfer_config=kv_config(server.url))
    return server


def test_long_load_does_not_stall_another_requests_decode(
    model_dir: Path, long_stored: ServerProc, reference: EngineRun
) -> None:
    server = long_stored
    # P_LONG's load takes 3 s on purpose; P_TURN1 (not cached) is prefilled and decodes meanwhile.
    kv = kv_config(server.url, async_loads=True, in_step_load_share=0, debug_load_delay_s=3.0)
    run = run_engine(
        model_dir,
        [[prompt(P_TURN1), prompt(P_LONG)]],
        max_tokens=MAX_TOKENS,
        kv_transfer_config=kv,
        extra_spec={"connector_stats": True},
    )
    other, loaded = run.requests
    stats = run.batches[0].connector_stats
    assert stats is not None
    assert loaded.connector_loaded_tokens == 512 and stats["load_errors"] == 0
    assert loaded.token_ids == reference.batches[0].requests[0].token_ids
    # every decode step of the other request ran while the load was in flight (with loads in the
    # step, the first step would have waited the whole 3 s and the count would be 0)
    assert stats["steps_during_loads"] >= MAX_TOKENS - 1
    assert stats["parked_steps"] >= MAX_TOKENS - 1 and stats["loads_in_step"] == 0  # vLLM parked it meanwhile
    assert len(other.token_ids) == MAX_TOKENS


def test_a_short_load_runs_in_the_step_and_parks_its_request_for_no_step(
    model_dir: Path, long_stored: ServerProc, reference: EngineRun
) -> None:
    """A hit whose copy is estimated short against the engine's step is loaded inside the step:
    vLLM schedules the request in the step its lookup answered. In the background, vLLM would park it
    (WAITING_FOR_REMOTE_KVS) for at least one step, its blocks held while it computes nothing (the
    test above counts those steps). The first batch gives the engine's step period and the load rate
    (the worker's calibration); in_step_load_share 100 takes the load into the step whatever this
    host's speed, so the count does not depend on it."""
    kv = kv_config(long_stored.url, in_step_load_share=100.0)
    run = run_engine(
        model_dir,
        [[prompt(P_TURN1)], [prompt(P_LONG)]],
        max_tokens=MAX_TOKENS,
        kv_transfer_config=kv,
        extra_spec={"connector_stats": True},
    )
    loaded = run.requests[1]
    stats = run.batches[1].connector_stats
    assert stats is not None and stats["load_errors"] == 0, stats
    assert loaded.connector_loaded_tokens == len(P_LONG) - 1  # two chunks and the prompt's stored tail
    assert stats["loads_in_step"] == 1 and stats["parked_steps"] == 0, stats
    assert loaded.token_ids == reference.batches[0].requests[0].token_ids
    # Its chunks were on the server, so its two tails (the prompt's and the answer's) were its only
    # saves: saved in the step after it finished, before that step's forward, and vLLM freed its
    # blocks at the end of that step (on the save thread they were freed steps later)
    assert stats["tail_saves"] == stats["tails_before_forward"] == 2, stats
    assert stats["finished_held_steps"] == 0, stats


def test_async_load_failure_is_recomputed(model_dir: Path, long_stored: ServerProc, reference: EngineRun) -> None:
    server = long_stored
    kv = kv_config(server.url, async_loads=True, in_step_load_share=0, debug_fail_load_chunks=[1])
    run = run_engine(model_dir, [[prompt(P_LONG)]], max_tokens=MAX_TOKENS, kv_transfer_config=kv)
    r = run.requests[0]
    assert r.kv_transfer_params["kvserver"]["load_failed"] is True
    assert r.connector_loaded_tokens == 256  # chunk 0 loaded; chunk 1 on was recomputed
    assert r.token_ids == reference.batches[0].requests[0].token_ids


def test_async_load_failing_from_the_first_chunk_is_tried_once(
    model_dir: Path, long_stored: ServerProc, reference: EngineRun
) -> None:
    """A load that leaves nothing valid (chunk 0 fails, e.g. a corrupt object) sends the request back
    to vLLM's waiting queue with no computed tokens, and vLLM asks the connector again. The same load
    would fail again, for ever: the connector answers 0 and the request is recomputed."""
    server = long_stored
    kv = kv_config(server.url, async_loads=True, in_step_load_share=0, debug_fail_load_chunks=[0])
    run = run_engine(
        model_dir,
        [[prompt(P_LONG)]],
        max_tokens=MAX_TOKENS,
        kv_transfer_config=kv,
        extra_spec={"connector_stats": True},
        timeout=300,
    )
    r = run.requests[0]
    stats = run.batches[0].connector_stats
    assert stats is not None and stats["loads"] == 1 and stats["load_errors"] == 1
    assert r.kv_transfer_params["kvserver"]["load_failed"] is True
    assert r.connector_loaded_tokens == 0
    assert r.token_ids == reference.batches[0].requests[0].token_ids


def test_a_load_does_not_queue_behind_earlier_saves(
    model_dir: Path, long_stored: ServerProc, reference: EngineRun
) -> None:
    """One request at a time (max_num_seqs 1): P_LONG is scheduled once P_SALTED finished, whose save
    was submitted before P_LONG's load and is held until a load ended (at most 30 s). The load runs
    on its own thread and ends while that save is still held; on a thread shared with saves it
    would wait behind the save (30 s, then count 0). No clock is raced: the count is taken as the
    load ends, before the save is released. P_SALTED is a prompt no other test of this module
    stores on the shared server. The scheduler waits for each lookup's answer (lookup_wait_s 1 s):
    with the default 2 ms, a busy host answers P_SALTED's lookup late, vLLM skips it for a step and
    schedules P_LONG first, whose load then ends before any save was submitted."""
    kv = kv_config(
        long_stored.url,
        in_step_load_share=0,
        debug_save_delay_s=30.0,
        debug_hold_saves_for_load=True,
        lookup_wait_s=1.0,
    )
    run = run_engine(
        model_dir,
        [[prompt(P_SALTED), prompt(P_LONG)]],
        max_tokens=MAX_TOKENS,
        kv_transfer_config=kv,
        llm_kwargs={"max_num_seqs": 1},
        extra_spec={"connector_stats": True},
    )
    saved, loaded = run.requests
    stats = run.batches[0].connector_stats
    # P_SALTED's two chunks and its two tails (the prompt's, and with the answer: save_policy "all");
    # P_LONG's tails are on the server already
    assert stats is not None and stats["load_errors"] == 0 and stats["saved_chunks"] == 4, repr(stats)
    assert loaded.connector_loaded_tokens == len(P_LONG) - 1
    assert stats["loads_past_saves"] == 1, stats
    assert loaded.token_ids == reference.batches[0].requests[0].token_ids
    assert saved.token_ids == reference.batches[3].requests[0].token_ids


def test_async_save_keeps_blocks_until_stored(
    model_dir: Path, kvserver_factory: ServerFactory, reference: EngineRun
) -> None:
    """A save that takes 2 s after its request finished: with 32 KV blocks in all, the next request
    needs P_LONG's blocks, and gets them only once the save has read them (vLLM frees them on our
    "finished sending"). Had they been freed at once, the save would store the next prompt's KV
    under P_LONG's keys, and the second engine's output would differ from the reference."""
    server = kvserver_factory()
    kv = kv_config(server.url, async_saves=True, debug_save_delay_s=2.0)
    first = run_engine(
        model_dir,
        [[prompt(P_LONG)], [prompt(P_TURN1)]],
        max_tokens=MAX_TOKENS,
        kv_transfer_config=kv,
        max_model_len=960,
        llm_kwargs={"num_gpu_blocks_override": 32},
        extra_spec={"connector_stats": True},
    )
    assert first.requests[0].token_ids == reference.batches[0].requests[0].token_ids
    assert first.requests[1].token_ids == reference.batches[1].requests[0].token_ids
    # Meanwhile vLLM stepped with nothing to compute (P_TURN1 waits for blocks, P_LONG for its save):
    # such steps wait for the save (up to 2 ms each) instead of stepping again at once
    stats = first.batches[1].connector_stats
    assert stats is not None and stats["idle_waits"] >= 1, stats
    # every tail save was handed to the save thread when vLLM bound the step's metadata, before the
    # forward (start_tails), not after it: the blocks it holds can be freed at the end of that step
    tails = [b.connector_stats or {} for b in first.batches]
    assert sum(t["tail_saves"] for t in tails) >= 2, tails
    assert [t["tails_before_forward"] for t in tails] == [t["tail_saves"] for t in tails], tails
    run = run_engine(model_dir, [[prompt(P_LONG)]], max_tokens=MAX_TOKENS, kv_transfer_config=kv_config(server.url))
    r = run.requests[0]
    assert r.connector_loaded_tokens == 512
    assert r.token_ids == reference.batches[0].requests[0].token_ids
