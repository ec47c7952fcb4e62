"""The scheduler never waits for L2: while the server prefetches, the connector reports the hit L1 + L2
will cover (the server's `expected_tokens`) and vLLM's background load copies chunks as they land
(stream_l2, the default); an answer still on its way is "ask again later" (None); so is a prefix
another engine announced it is computing, which the engine then loads once it lands."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvprotocol import Client, KeySpace, LayoutDescriptor, pack_tokens
from kvtestkit.kvhelpers import retrieve, sid, store
from kvtestkit.serverproc import KVServer, ServerFactory
from vllm_cases import MAX_TOKENS, P_LONG, kv_config
from kvtestkit.engines.tiny_model import random_prompt
from kvtestkit.engines.vllm_harness import EngineRun, prompt, run_engine

pytestmark = pytest.mark.vllm_engine
CHUNK = 256


@dataclass
class Stored:
    server: KVServer
    run: EngineRun  # the engine run that computed and stored P_LONG


@pytest.fixture(scope="module")
def p_long_stored(model_dir: Path, kvserver_factory: ServerFactory) -> Stored:
    """A server holding P_LONG's two chunks, stored by one engine run (the tests below share it)."""
    server = kvserver_factory()
    run = run_engine(
        model_dir,
        [[prompt(P_LONG)]],
        max_tokens=MAX_TOKENS,
        kv_transfer_config=kv_config(server.url),
        extra_spec={"connector_stats": True},
    )
    return Stored(server, run)


def _l2_puts(url: str) -> int:
    with Client(url) as c:
        return int(c.call("describe").result["l2"][0]["puts"])


def test_an_l2_hit_is_reported_while_it_streams_into_l1_and_loaded_as_it_lands(
    model_dir: Path, kvserver_factory: ServerFactory, reference: EngineRun, tmp_path: Path
) -> None:
    l2 = ("--l2", f"fs://{tmp_path / 'l2'}")
    first = kvserver_factory(*l2)
    run_engine(model_dir, [[prompt(P_LONG)]], max_tokens=MAX_TOKENS, kv_transfer_config=kv_config(first.url))
    deadline = time.monotonic() + 30
    while _l2_puts(first.url) < 2:  # write-behind of P_LONG's two chunks
        assert time.monotonic() < deadline, "the L2 write-behind did not happen"
        time.sleep(0.05)
    first.stop()
    second = kvserver_factory(*l2)  # a fresh process: L1 empty, L2 holds both chunks
    run = run_engine(
        model_dir,
        [[prompt(P_LONG)]],
        max_tokens=MAX_TOKENS,
        kv_transfer_config=kv_config(second.url),
        extra_spec={"connector_stats": True},
    )
    r = run.requests[0]
    stats = run.batches[0].connector_stats
    assert stats is not None
    # the hit was reported from the answer that started the prefetch (pending, with expected_tokens),
    # not after it ended: the load was a streamed one
    assert stats["lookups_streamed"] == 1 and stats["lookups_pending"] == 0
    assert stats["loads_streamed_apart"] == 1  # on the worker's stream thread, not queued with L1 loads
    assert stats["load_errors"] == 0 and stats["verify_failures"] == 0
    assert r.connector_loaded_tokens == 512 and r.kv_transfer_params["kvserver"]["l2_tokens"] == 512
    assert r.token_ids == reference.batches[0].requests[0].token_ids


def _run_with_server_stopped(
    model_dir: Path, server: KVServer, tmp_path: Path, stop_s: float, **kv: object
) -> EngineRun:
    """One request of P_LONG on a fresh engine; the server is stopped (SIGSTOP) for `stop_s` from
    the moment the request is let through, so its lookup's answer comes that much later."""
    gate = tmp_path / "go"
    assert server.proc is not None
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(
            run_engine,
            model_dir,
            [[prompt(P_LONG)]],
            max_tokens=MAX_TOKENS,
            kv_transfer_config=kv_config(server.url, timeout_s=30.0, **kv),
            extra_spec={"gates": {"0": str(gate)}, "connector_stats": True},
        )
        waiting = Path(str(gate) + ".waiting")
        while not waiting.exists():  # the engine is up (registered, calibrated) and idle at the gate
            assert not future.done(), future.result()
            time.sleep(0.1)
        server.proc.send_signal(signal.SIGSTOP)
        try:
            gate.touch()
            time.sleep(stop_s)  # the lookup is sent and not answered
        finally:
            server.proc.send_signal(signal.SIGCONT)
        return future.result()


def test_a_late_lookup_answer_defers_the_request(
    model_dir: Path, p_long_stored: Stored, reference: EngineRun, tmp_path: Path
) -> None:
    """The scheduler waits at most lookup_wait_s for a lookup's answer. With the server stopped
    (SIGSTOP) when a request arrives, the connector answers "ask again later" (None) instead of
    holding vLLM's step loop; once the server runs again, the answer arrives and the hit is loaded.
    (With no request running the scheduler waits up to lookup_wait_idle_s: 1.5 s is longer.)"""
    run = _run_with_server_stopped(model_dir, p_long_stored.server, tmp_path, 1.5)
    r = run.requests[0]
    stats = run.batches[0].connector_stats
    assert stats is not None
    assert stats["lookups_deferred"] >= 1 and stats["lookups"] == 1 and stats["lookup_errors"] == 0
    assert r.connector_loaded_tokens == 512
    assert r.token_ids == reference.batches[0].requests[0].token_ids


def test_an_idle_engine_waits_for_a_late_lookup_answer_instead_of_stepping_empty(
    model_dir: Path, kvserver_factory: ServerFactory, reference: EngineRun, tmp_path: Path
) -> None:
    """With no request running, a wait for the lookup's answer halts nobody: the scheduler waits up
    to lookup_wait_idle_s rather than answer "ask again later", which would make vLLM run empty steps
    until the answer came. The server is stopped for 0.2 s when the lone request arrives; within the
    1 s idle wait its answer comes, and the request is never deferred."""
    run = _run_with_server_stopped(model_dir, kvserver_factory(), tmp_path, 0.2, lookup_wait_idle_s=1.0)
    stats = run.batches[0].connector_stats
    assert stats is not None
    assert stats["lookups"] == 1 and stats["lookup_errors"] == 0
    assert stats["lookups_deferred"] == 0  # with the busy-step wait (2 ms before any step) it is deferred
    assert stats["scheduler_wait_s"] >= 0.1  # it did wait for the stopped server's answer
    assert run.requests[0].token_ids == reference.batches[0].requests[0].token_ids


def test_a_repeated_call_for_a_request_vllm_could_not_schedule_is_answered_from_its_miss_then_its_hit(
    model_dir: Path, kvserver_factory: ServerFactory
) -> None:
    """First engine: prefill without chunking and a step budget of one prompt, so the second of two
    700-token prompts finds nothing on the server, does not fit the first prefill's step, and vLLM
    asks about it again in the next step: that call is answered from the miss (lookups_reused).
    Second engine, KV blocks for one prompt at a time: both prompts hit; the second waits for blocks
    while the first loads and runs, and vLLM asks about it at every step meanwhile: those calls are
    answered from its hit under the leases its one lookup took. Either way a new round trip could
    cost the request another step; without the reuse each step would send one."""
    server = kvserver_factory()
    prompts = [prompt(random_prompt(700, seed=41)), prompt(random_prompt(700, seed=42))]
    # every answer awaited, and the answers stand longer than any step of a busy host: the counts
    # do not race a clock
    kv = kv_config(server.url, lookup_wait_s=1.0, lookup_miss_reuse_s=30.0, lookup_hit_reuse_s=5.0)
    first = run_engine(
        model_dir,
        [prompts],
        max_tokens=MAX_TOKENS,
        max_model_len=1024,
        kv_transfer_config=kv,
        llm_kwargs={"enable_chunked_prefill": False, "max_num_batched_tokens": 1024},
        extra_spec={"connector_stats": True},
    )
    stats = first.batches[0].connector_stats
    assert stats is not None and stats["lookup_errors"] == 0
    assert stats["lookups"] == 2 and stats["lookups_reused"] >= 1, stats
    assert all(len(r.token_ids) == MAX_TOKENS for r in first.requests)
    second = run_engine(
        model_dir,
        [prompts],
        max_tokens=MAX_TOKENS,
        max_model_len=1024,
        kv_transfer_config=kv,
        llm_kwargs={"num_gpu_blocks_override": 33},  # 1024 tokens and the null block: one prompt at a time
        extra_spec={"connector_stats": True},
    )
    stats = second.batches[0].connector_stats
    assert stats is not None and stats["lookup_errors"] == 0 and stats["load_errors"] == 0
    assert stats["lookups"] == 2 and stats["lookups_reused"] >= 1, stats
    assert [r.connector_loaded_tokens for r in second.requests] == [512, 512]
    assert [r.token_ids for r in second.requests] == [r.token_ids for r in first.requests]


def test_an_engine_waits_for_a_prefix_being_computed_and_loads_it_when_it_lands(
    model_dir: Path, p_long_stored: Stored, kvserver_factory: ServerFactory, reference: EngineRun, tmp_path: Path
) -> None:
    """Engine E's request for P_LONG arrives while the server holds an announcement of P_LONG's chunks
    (`announce`, as an engine computing them makes before its forward): E's lookup is answered
    `inflight` and the request waits. When the chunks land (here: the test stores the KV the first
    engine computed for P_LONG, byte for byte), E's next lookup hits and E loads them; its output is
    the reference's."""
    first_stats = p_long_stored.run.batches[0].connector_stats
    assert first_stats is not None and first_stats["announced_chunks"] == 2  # before the forward that computed them
    server = kvserver_factory()  # E's server: empty
    gate = tmp_path / "go"
    with ThreadPoolExecutor(1) as pool, Client(server.url) as c, Client(p_long_stored.server.url) as old:
        future = pool.submit(
            run_engine,
            model_dir,
            [[prompt(P_LONG)]],
            max_tokens=MAX_TOKENS,
            kv_transfer_config=kv_config(server.url),
            extra_spec={"gates": {"0": str(gate)}, "connector_stats": True},
        )
        while not Path(str(gate) + ".waiting").exists():  # E is up (registered) and idle at the gate
            assert not future.done(), future.result()
            time.sleep(0.1)
        engine = c.call("describe").result["engines"][0]
        ks = KeySpace.from_layouts(
            engine["model"], engine["world_size"], [LayoutDescriptor.from_wire(g) for g in engine["groups"]]
        )
        session = sid("test-reader-of-p-long")
        hit = old.call("lookup", keyspace=ks.to_wire(), tokens=pack_tokens(P_LONG), session=session).result
        assert hit["hit_tokens"] == 2 * CHUNK
        kv = retrieve(old, session, 0, 2)  # the first engine's KV of P_LONG, as it stored it
        old.call("release", session=session)
        assert old.call("describe").result["announcements"]["announced"] >= 2
        # "another engine" computes P_LONG now and will store it within 5 s
        got = c.call(
            "announce",
            keyspace=ks.to_wire(),
            tokens=pack_tokens(P_LONG),
            session=sid("the-computing-engine"),
            ttl_s=5.0,
        )
        assert got.result["announced"] == 2
        gate.touch()
        deadline = time.monotonic() + 30
        while c.call("describe").result["announcements"]["waits"] < 3:  # E asked, and asks again
            assert time.monotonic() < deadline and not future.done()
            time.sleep(0.02)
        store(c, ks, P_LONG[: 2 * CHUNK], lambda chunk, group: kv[(chunk, group)])  # its save lands
        run = future.result()
    r, stats = run.requests[0], run.batches[0].connector_stats
    assert stats is not None
    assert stats["lookups_inflight"] >= 3  # it waited for the chunks instead of computing them
    assert r.connector_loaded_tokens == 2 * CHUNK and r.num_cached_tokens == 2 * CHUNK
    assert r.token_ids == reference.batches[0].requests[0].token_ids
