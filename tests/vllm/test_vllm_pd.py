"""Prefill/decode disaggregation through kvserver with real vLLM (bench/pd/proxy.py): a kv_producer
engine prefills each request (max_tokens=1) and stores its full chunks under a whole-request
reservation; a kv_consumer engine in another process loads them and computes only the tail."""

from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvtestkit.kvhelpers import payload, store
from kvprotocol import Client, KeySpace, LayoutDescriptor, pack_tokens
from kvtestkit.serverproc import ServerFactory
from kvtestkit.engines.tiny_model import random_prompt
from vllm_cases import MAX_TOKENS, P_LONG
from kvtestkit.engines.vllm_harness import VLLM_PYTHON, EngineRun, engine_env, prompt, run_engine

from bench.pd.proxy import Engine, kv_config, run_pd, run_single

pytestmark = pytest.mark.vllm_engine
CHUNK = 256
PROMPTS = [P_LONG, random_prompt(600, seed=21), random_prompt(300, seed=22)]


def test_prefill_then_decode_matches_one_engine_and_decode_computes_only_the_tail(
    model_dir: Path, kvserver_factory: ServerFactory, tmp_path: Path
) -> None:
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
    loaded = []
    for i, (p, a, b) in enumerate(zip(PROMPTS, base["requests"], pd["requests"])):
        assert b["token_ids"] == a["token_ids"]  # greedy: identical to one engine doing both
        # The producer stores each prompt's full chunks and, as it finishes, its tail. The decode
        # engine's first request asks before its workers told its scheduler that the server takes
        # tails: it loads the full chunks and computes the tail after them; the later ones load
        # everything but the last token
        loaded.append(len(p) // CHUNK * CHUNK if i == 0 else len(p) - 1)
        assert b["num_cached_tokens"] == loaded[-1]
    full_chunks = sum(len(p) // CHUNK for p in PROMPTS)
    # and the tails of the prompts after the first (every prompt ends inside a chunk; the first one
    # finishes in the step whose report first tells the producer's scheduler that the server takes tails)
    assert produced["saved_chunks"] == full_chunks + len(PROMPTS) - 1
    assert produced.get("hit_tokens", 0) == 0 and produced.get("loaded_tokens", 0) == 0  # a producer never loads
    assert consumed["loaded_tokens"] == sum(loaded)
    assert consumed.get("saved_chunks", 0) == 0  # a consumer never stores


def test_consumer_waits_for_a_producer_in_flight_and_recomputes_when_it_dies(
    model_dir: Path, kvserver_factory: ServerFactory, reference: EngineRun, tmp_path: Path
) -> None:
    """A producer reserved P_LONG (2 chunks), committed chunk 0 (here: bytes that are NOT the model's
    KV) and died. The decode engine is told `inflight` and asks again later instead of loading; one
    lease TTL later the server rolls the reservation back (chunk 0 dropped), and the engine recomputes:
    its tokens are the reference's, so the half-written request was never loaded."""
    server = kvserver_factory("--lease-ttl", "3")
    gate = tmp_path / "gate"
    result: dict[str, Any] = {}

    def run() -> None:
        result["run"] = run_engine(
            model_dir,
            [[prompt(P_LONG)]],
            max_tokens=MAX_TOKENS,
            kv_transfer_config=kv_config(server.url, "kv_consumer", inflight_wait_s=120),
            extra_spec={"connector_stats": True, "gates": {"0": str(gate)}},
            workdir=tmp_path / "decode",
        )

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 300
    while not Path(str(gate) + ".waiting").exists():  # the engine registered and waits at the gate
        assert thread.is_alive() and time.monotonic() < deadline, result
        time.sleep(0.2)
    with Client(server.url) as c:
        engine = c.call("describe").result["engines"][0]
        layouts = [LayoutDescriptor.from_wire(g) for g in engine["groups"]]
        ks = KeySpace.from_layouts(engine["model"], engine["world_size"], layouts)
        junk = [payload(7, lay.object_bytes) for lay in layouts]
        store(c, ks, P_LONG[:CHUNK], lambda ch, g: junk[g], reservation=secrets.token_hex(16), total_chunks=2)
        assert c.call("lookup", keyspace=ks.to_wire(), tokens=pack_tokens(P_LONG)).result["inflight"]
        gate.touch()  # the producer is now "dead": it never stores chunk 1 nor refreshes its reservation
        thread.join(600)
        book = c.call("describe").result["reservations"]
    run = result["run"]
    r, stats = run.requests[0], run.batches[0].connector_stats
    assert stats is not None
    assert stats["lookups_inflight"] >= 1  # it waited for the producer instead of missing at once
    assert r.token_ids == reference.batches[0].requests[0].token_ids  # and then recomputed everything
    assert r.num_cached_tokens == 0 and stats.get("loaded_tokens", 0) == 0
    assert book["rolled_back"] == 1 and book["live"] == 0
