"""KVServerConnector when things go wrong: failed loads are recomputed, a dead server is a miss."""

from __future__ import annotations

import mmap
import os
import signal
import time
from pathlib import Path

import pytest

from kvprotocol import Client
from kvserver.l1.arena import HEADER_BYTES
from kvtestkit.serverproc import ServerFactory
from vllm_cases import MAX_TOKENS, P_GEN, P_LONG, P_TURN1, confirmed, kv_config
from kvtestkit.engines.vllm_harness import EngineRun, prompt, run_engine

pytestmark = pytest.mark.vllm_engine


def test_failed_load_is_recomputed(model_dir: Path, kvserver_factory: ServerFactory, reference: EngineRun) -> None:
    server = kvserver_factory()
    run_engine(model_dir, [[prompt(P_LONG)]], max_tokens=MAX_TOKENS, kv_transfer_config=kv_config(server.url))
    # Fault injection: after the load, chunk 1's blocks are overwritten with garbage and reported as
    # failed. Unless vLLM recomputes them, the output cannot match the reference.
    kv = kv_config(server.url, policy="recompute", debug_fail_load_chunks=[1])
    run = run_engine(model_dir, [[prompt(P_LONG)]], max_tokens=MAX_TOKENS, kv_transfer_config=kv)
    r = run.requests[0]
    assert r.kv_transfer_params["kvserver"]["load_failed"] is True
    assert r.connector_loaded_tokens == 256  # chunk 0 loaded; chunk 1 on was recomputed
    assert r.token_ids == reference.batches[0].requests[0].token_ids
    assert "load of 8 blocks failed" in run.log


def test_corrupted_arena_bytes_are_verified_and_recomputed(
    model_dir: Path, kvserver_factory: ServerFactory, reference: EngineRun
) -> None:
    """One flipped byte in a cached object (what a stray write or a bad DIMM does): the second engine's
    load fails verification, vLLM recomputes, and the tokens equal the no-connector reference."""
    server = kvserver_factory()
    run_engine(model_dir, [[prompt(P_LONG)]], max_tokens=MAX_TOKENS, kv_transfer_config=kv_config(server.url))
    with Client(server.url) as c:
        l1 = c.call("describe").result["l1"]
    assert l1["objects"] >= 2
    fd = os.open(f"/dev/shm/{l1['arena']}", os.O_RDWR)
    try:
        arena = mmap.mmap(fd, l1["capacity_bytes"])
    finally:
        os.close(fd)
    # The arena's first page is its header (magic and instance nonce); the first slot after it holds
    # the first object stored (chunk 0).
    first = HEADER_BYTES
    assert any(arena[first : first + 4096])
    arena[first + 100] ^= 0x01
    arena.close()
    run = run_engine(
        model_dir,
        [[prompt(P_LONG)]],
        max_tokens=MAX_TOKENS,
        kv_transfer_config=kv_config(server.url, policy="recompute"),
    )
    r = run.requests[0]
    assert r.kv_transfer_params["kvserver"]["load_failed"] is True
    assert r.connector_loaded_tokens == 0  # chunk 0 failed, so the whole load did
    assert r.token_ids == reference.batches[0].requests[0].token_ids
    assert "checksum" in run.log
    with Client(server.url) as c:  # the load's release reported it: checked by the server and dropped
        counters = c.call("describe").result["counters"]
    assert (counters["corrupt_dropped"], counters["corrupt_refuted"]) == (1, 0)


def test_server_killed_between_engines(model_dir: Path, kvserver_factory: ServerFactory, reference: EngineRun) -> None:
    server = kvserver_factory()
    kv = kv_config(server.url, timeout_s=1.0)
    a = run_engine(model_dir, [[prompt(P_LONG)], [prompt(P_GEN)]], max_tokens=MAX_TOKENS, kv_transfer_config=kv)
    assert confirmed(a.requests[0].kv_transfer_params, 512)
    # save_policy "prompt" (the default) stores only chunks made of prompt tokens
    assert confirmed(a.requests[1].kv_transfer_params, 256)
    server.kill()
    b = run_engine(model_dir, [[prompt(P_LONG)], [prompt(P_LONG[:600])]], max_tokens=MAX_TOKENS, kv_transfer_config=kv)
    want = reference.batches[0].requests[0].token_ids
    assert b.requests[0].token_ids == want
    assert all(r.connector_loaded_tokens == 0 for r in b.requests)
    for r in b.requests:
        assert r.kv_transfer_params["kvserver"]["hit_tokens"] == 0
        assert r.kv_transfer_params["kvserver"]["stored_tokens"] == 0  # the store failed, and it knows


def test_a_running_engine_rides_through_a_kill9_and_warm_restart(
    model_dir: Path, kvserver_factory: ServerFactory, reference: EngineRun, tmp_path: Path
) -> None:
    """The server is killed with SIGKILL between two batches of one engine and started again on its
    port: it adopts the arena, and the engine (never restarted) loads the prefix it stored before the
    kill, with the reference's tokens. The new server stores nothing: the hits are adopted objects."""
    from concurrent.futures import ThreadPoolExecutor

    server = kvserver_factory()
    gate = tmp_path / "restarted"
    kv = kv_config(server.url, timeout_s=1.0, retry_after_s=0.1)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(
            run_engine,
            model_dir,
            [[prompt(P_LONG)], [prompt(P_LONG)], [prompt(P_LONG)]],
            max_tokens=MAX_TOKENS,
            kv_transfer_config=kv,
            llm_kwargs={"enable_prefix_caching": False},  # every hit is the server's, none the engine's own
            extra_spec={"gates": {"1": str(gate)}},
        )
        waiting = Path(str(gate) + ".waiting")
        while not waiting.exists():
            assert not future.done(), future.result()
            time.sleep(0.1)
        server.stop(signal.SIGKILL)  # a crash: the arena and its journal stay in /dev/shm
        server.start()
        with Client(server.url) as c:
            while (warm := c.call("describe").result["warm_restart"])["pending"]:
                time.sleep(0.05)
        gate.touch()
        run = future.result()
    assert warm["adopted"] == warm["verified"] >= 2 and warm["rejected"] == 0, server.log()
    with Client(server.url) as c:
        counters = c.call("describe").result["counters"]
    want = reference.batches[0].requests[0].token_ids
    first, after, again = (b.requests[0] for b in run.batches)
    assert first.token_ids == after.token_ids == again.token_ids == want
    assert confirmed(first.kv_transfer_params, 512)
    # the first request after the restart finds the adopted arena's new nonce, registers again and
    # loads the adopted chunks (no miss for the restart), and the prompt's tail with them: the journal
    # kept its length (docs/protocol.md, "Tails"), so both load all but the last token
    assert after.connector_loaded_tokens == again.connector_loaded_tokens == len(P_LONG) - 1
    assert counters["stored_objects"] == 0 and counters["deduplicated_objects"] >= 1
    assert counters["lookup_hit_tokens"] >= 2 * 512


def test_server_absent_at_start_then_back(
    model_dir: Path, kvserver_factory: ServerFactory, reference: EngineRun, tmp_path: Path
) -> None:
    """No server when the engine starts: it runs, recomputes, and reconnects once the server is up.

    The connector's counters reach vLLM's scheduler stats (the get_kv_connector_stats hook) and
    tell both halves of the story.
    """
    from concurrent.futures import ThreadPoolExecutor

    from kvtestkit.serverproc import KVServer

    server = KVServer(tmp_path / "kvserver.log", "--l1-size-gb", "0.25")  # its port, not started yet
    gate = tmp_path / "server-up"
    kv = kv_config(server.url, timeout_s=1.0, retry_after_s=0.1)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(
            run_engine,
            model_dir,
            [[prompt(P_LONG)], [prompt(P_TURN1)]],
            max_tokens=MAX_TOKENS,
            kv_transfer_config=kv,
            extra_spec={"gates": {"1": str(gate)}, "connector_stats": True},
        )
        waiting = Path(str(gate) + ".waiting")
        while not waiting.exists():
            assert not future.done(), future.result()
            time.sleep(0.1)
        server.start()
        try:
            # The server comes back "a while later": after a timeout the EngineClient fails fast for
            # its backoff (min(1 s, timeout)), so a request right at that moment would still miss.
            time.sleep(1.5)
            gate.touch()
            run = future.result()
            with Client(server.url) as c:
                described = c.call("describe").result
        finally:
            server.stop()
    down, up = run.batches
    assert down.requests[0].token_ids == reference.batches[0].requests[0].token_ids
    assert down.requests[0].kv_transfer_params["kvserver"]["stored_tokens"] == 0
    assert down.connector_stats is not None
    assert down.connector_stats["lookup_errors"] + down.connector_stats["skipped_server_down"] >= 1
    assert down.connector_stats["saved_chunks"] == 0
    assert up.requests[0].token_ids == reference.batches[1].requests[0].token_ids
    # Saves are asynchronous: stored_tokens counts what the server confirmed by the time the request
    # finished (the first save after a reconnect may still be on its way); the batch's counters and
    # the server's, read after the engine's background work ended, count all of it.
    assert up.requests[0].kv_transfer_params["kvserver"]["stored_tokens"] in (0, 256, 512)
    assert up.connector_stats is not None
    assert up.connector_stats["lookups"] >= 1 and up.connector_stats["saved_chunks"] == 2
    assert described["counters"]["stored_objects"] == 2 and described["counters"]["lookups"] >= 1
    # The same counters reach vLLM's own Prometheus registry (its /metrics), summed over the run.
    assert run.prometheus is not None
    for name in ("lookups", "lookup_errors", "saved_chunks", "lookup_tokens", "hit_tokens"):
        total = down.connector_stats.get(name, 0) + up.connector_stats.get(name, 0)
        assert run.prometheus[f"vllm:kvserver_{name}_total"] == total, name


def test_roles_producer_saves_only_consumer_loads_only(
    model_dir: Path, kvserver_factory: ServerFactory, reference: EngineRun
) -> None:
    server = kvserver_factory()
    producer = {**kv_config(server.url), "kv_role": "kv_producer"}
    a = run_engine(
        model_dir,
        [[prompt(P_LONG)], [prompt(P_LONG)]],
        max_tokens=MAX_TOKENS,
        kv_transfer_config=producer,
        llm_kwargs={"enable_prefix_caching": False},
    )
    want = reference.batches[0].requests[0].token_ids
    first, second = a.requests
    assert confirmed(first.kv_transfer_params, 512)
    assert second.kv_transfer_params["kvserver"]["hit_tokens"] == 0  # a producer never looks up
    assert second.connector_loaded_tokens == 0 and second.token_ids == want
    consumer = {**kv_config(server.url), "kv_role": "kv_consumer"}
    b = run_engine(model_dir, [[prompt(P_LONG)], [prompt(P_TURN1)]], max_tokens=MAX_TOKENS, kv_transfer_config=consumer)
    loaded, fresh = b.requests
    assert loaded.connector_loaded_tokens == 512 and loaded.token_ids == want
    assert fresh.kv_transfer_params["kvserver"]["stored_tokens"] == 0  # a consumer never stores
    assert fresh.token_ids == reference.batches[1].requests[0].token_ids
    with Client(server.url) as c:
        # only the producer's: P_LONG's two chunks and its tail (a consumer's first request asks
        # before its workers told the scheduler that the server takes tails: it loads whole chunks)
        assert c.call("describe").result["counters"]["stored_objects"] == 3


def test_load_the_scheduler_cannot_name_fails_safe(
    model_dir: Path, kvserver_factory: ServerFactory, reference: EngineRun
) -> None:
    """_plan's "cannot happen" branch (vLLM was promised external tokens, but the blocks cannot be
    named): the blocks are reported failed and recomputed, never computed over uninitialised."""
    server = kvserver_factory()
    run_engine(model_dir, [[prompt(P_LONG)]], max_tokens=MAX_TOKENS, kv_transfer_config=kv_config(server.url))
    kv = kv_config(server.url, debug_fail_plan_loads=True)
    run = run_engine(model_dir, [[prompt(P_LONG)]], max_tokens=MAX_TOKENS, kv_transfer_config=kv)
    r = run.requests[0]
    assert r.kv_transfer_params["kvserver"]["hit_tokens"] == 512
    assert r.kv_transfer_params["kvserver"]["load_failed"] is True
    assert r.connector_loaded_tokens == 0
    assert r.token_ids == reference.batches[0].requests[0].token_ids
    assert "reporting them failed" in run.log and "load of 16 blocks failed" in run.log
