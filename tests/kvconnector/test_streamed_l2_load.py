"""Streamed L2 hits (#38): a lookup with `expect` answers how far L1 + L2 will cover while the server's
prefetch still runs, and EngineClient.load_streamed copies chunks as they land in L1, each verified.
A chunk the prefetch does not bring fails (with every block after it), and is never reported loaded."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
from engine_kv_helpers import Geometry
from kvconnector.engine_client import EngineClient
from kvconnector.vllm.jobs import LoadJob
from kvconnector.vllm.loader import BackgroundLoader
from kvprotocol import KeySpace, ObjectKey, chunk_hashes, pack_tokens
from kvserver.l2.fs import FsAdapter
from kvtestkit.kvhelpers import sid
from test_verified_reads import assert_blocks_equal

GEO = Geometry("vllm_cpu")
LAY = GEO.layout()
CHUNK = GEO.chunk_size
BPC = CHUNK // GEO.block_size
MODEL = "stream/model"
CHUNKS = 6


def _engine(server) -> EngineClient:  # type: ignore[no-untyped-def]
    return EngineClient(server.url, MODEL, 1, 0, [LAY])


def _l2_only(server_factory, tmp_path: Path, tokens: np.ndarray, src, *extra: str):  # type: ignore[no-untyped-def]
    """A server whose L2 (fs) holds the prompt's chunks and whose L1 is empty, and the L2 root."""
    root = tmp_path / "l2"
    args = ("--l1-size-gb", "0.05", "--chunk-size", str(CHUNK), "--l2", f"fs://{root}", "--l2-prefetch-timeout", "10")
    args += extra
    first = server_factory(*args)
    with _engine(first) as a:
        assert a.register(src) and a.save(tokens, list(range(CHUNKS * BPC))).saved_chunks == CHUNKS
    first.stop()  # a graceful stop flushes the write-behind queue
    return server_factory(*args), root


def _l2_paths(root: Path, tokens: np.ndarray) -> list[Path]:
    ks = KeySpace.from_layouts(MODEL, 1, [LAY])
    fs = FsAdapter(root)
    return [
        fs.path_of(ObjectKey(ks.model, ks.groups[0], 1, 0, 0, "", h).to_str())
        for h in chunk_hashes(pack_tokens(tokens), CHUNK)
    ]


def test_a_pending_lookup_says_the_expected_hit_and_the_streamed_load_is_byte_identical(
    server_factory, tmp_path: Path
) -> None:
    src, dst = GEO.random_kv(CHUNKS * BPC, seed=7), GEO.sentinel_kv(CHUNKS * BPC + 4)
    tokens = np.random.default_rng(8).integers(0, 50_000, CHUNKS * CHUNK)
    server, _ = _l2_only(server_factory, tmp_path, tokens, src)
    with _engine(server) as b:
        assert b.register(dst)
        first = b.lookup(tokens, session=sid("stream"), wait=False, expect=True)
        # the answer of the lookup that started the prefetch: still pending, and how far it will reach
        assert first.error is None and first.pending and first.expected_tokens == CHUNKS * CHUNK
        ids = [CHUNKS * BPC + 3 - i for i in range(CHUNKS * BPC)]  # another order than the writer's
        res = b.load_streamed(sid("stream"), tokens, ids, 0, CHUNKS * CHUNK)
        assert res.ok and res.loaded_tokens == CHUNKS * CHUNK and not res.failed_block_ids
        assert b.verify_failures == 0
        whole = b.lookup(tokens, wait=False, expect=True)  # all of it in L1 now: no prefetch, nothing expected
        assert (whole.hit_tokens, whole.pending, whole.expected_tokens) == (CHUNKS * CHUNK, False, None)
    assert_blocks_equal(dst, ids, src, list(range(CHUNKS * BPC)))


def test_a_chunk_the_prefetch_does_not_bring_is_reported_failed_not_loaded(server_factory, tmp_path: Path) -> None:
    src, dst = GEO.random_kv(CHUNKS * BPC, seed=9), GEO.sentinel_kv(CHUNKS * BPC)
    tokens = np.random.default_rng(10).integers(0, 50_000, CHUNKS * CHUNK)
    server, root = _l2_only(server_factory, tmp_path, tokens, src, "--l2-verify", "server")
    bad = 3
    path = _l2_paths(root, tokens)[bad]
    flipped = bytearray(path.read_bytes())
    flipped[len(flipped) // 2] ^= (
        0x10  # a bit flip in the body: the file exists (contains says yes), its bytes are wrong
    )
    path.write_bytes(bytes(flipped))
    with _engine(server) as b:
        assert b.register(dst)
        first = b.lookup(tokens, session=sid("bad"), wait=False, expect=True)
        assert first.pending and first.expected_tokens == CHUNKS * CHUNK  # the corrupt file is found, not yet read
        ids = list(range(CHUNKS * BPC))
        res = b.load_streamed(sid("bad"), tokens, ids, 0, CHUNKS * CHUNK)
        assert not res.ok and "not_streamed" in (res.error or "")
        assert res.loaded_tokens == bad * CHUNK  # the chunks before the hole: copied and verified
        assert res.failed_block_ids == ids[bad * BPC :]  # the hole and every block after it
        assert b.verify_failures == 0  # refused by the server (corrupt in L2), never copied
        assert b.lookup(tokens).hit_tokens == bad * CHUNK
    assert_blocks_equal(dst, ids[: bad * BPC], src, list(range(bad * BPC)))
    with server.client() as raw:  # no lease is left behind by the failed load
        assert raw.call("describe").result["l1"]["leased"] == 0


def test_a_damaged_chunk_that_lands_fails_its_load_and_the_report_drops_it(server_factory, tmp_path: Path) -> None:
    """The default (`--l2-verify reader`): the damaged body lands unhashed; the streamed load's own
    kvsum64 check refuses it, the blocks from it on are failed (recomputed), and its release reports
    the chunk: the server finds it damaged and drops it from L1 and L2, so no later load meets it."""
    src, dst = GEO.random_kv(CHUNKS * BPC, seed=15), GEO.sentinel_kv(CHUNKS * BPC)
    tokens = np.random.default_rng(16).integers(0, 50_000, CHUNKS * CHUNK)
    server, root = _l2_only(server_factory, tmp_path, tokens, src)
    bad = 2
    path = _l2_paths(root, tokens)[bad]
    flipped = bytearray(path.read_bytes())
    flipped[len(flipped) // 2] ^= 0x10  # a bit flip in the body behind a sound header
    path.write_bytes(bytes(flipped))
    with _engine(server) as b:
        assert b.register(dst)
        first = b.lookup(tokens, session=sid("bad"), wait=False, expect=True)
        assert first.pending and first.expected_tokens == CHUNKS * CHUNK
        ids = list(range(CHUNKS * BPC))
        res = b.load_streamed(sid("bad"), tokens, ids, 0, CHUNKS * CHUNK)
        assert not res.ok and "checksum_mismatch" in (res.error or "")
        kept = res.loaded_tokens // CHUNK  # a copy round with a damaged object fails as a whole
        assert kept <= bad and res.failed_block_ids == ids[kept * BPC :]
        assert b.verify_failures == 1
    with server.client() as raw:
        counters = raw.call("describe").result["counters"]
        assert (counters["corrupt_dropped"], counters["corrupt_refuted"]) == (1, 0)
        assert raw.call("describe").result["l1"]["leased"] == 0
    deadline = time.monotonic() + 30
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not path.exists()  # deleted from L2 too
    assert _l2_paths(root, tokens)[bad + 1].exists()
    with _engine(server) as b:
        assert b.lookup(tokens).hit_tokens == bad * CHUNK  # not in L1, not brought back from L2
    assert_blocks_equal(dst, ids[: kept * BPC], src, list(range(kept * BPC)))


def test_an_l1_hit_does_not_wait_behind_a_streamed_load(server_factory, tmp_path: Path) -> None:
    """The worker's BackgroundLoader runs streamed loads on a thread and client of their own: a load
    of an L1 hit submitted after a streamed one ends while the streamed one still waits for its
    prefetch. Here the streaming server is stopped (SIGSTOP) mid-stream, a prefetch that takes as
    long as the test wants; the L1 hit is on another server."""
    src, dst = GEO.random_kv(CHUNKS * BPC, seed=11), GEO.sentinel_kv(2 * CHUNKS * BPC)
    streamed_tokens = np.random.default_rng(12).integers(0, 50_000, CHUNKS * CHUNK)
    l1_tokens = np.random.default_rng(13).integers(0, 50_000, CHUNKS * CHUNK)
    l2_server, _ = _l2_only(server_factory, tmp_path, streamed_tokens, src)
    l1_server = server_factory("--l1-size-gb", "0.05", "--chunk-size", str(CHUNK))
    with _engine(l1_server) as a:
        assert a.register(src) and a.save(l1_tokens, list(range(CHUNKS * BPC))).saved_chunks == CHUNKS
    l1_ids, streamed_ids = list(range(CHUNKS * BPC)), list(range(CHUNKS * BPC, 2 * CHUNKS * BPC))
    l1_client, streamer = _engine(l1_server), _engine(l2_server)
    loader = BackgroundLoader(l1_client, stream_client=streamer)
    try:
        assert loader.clients() == [l1_client, streamer] and all(c.register(dst) for c in loader.clients())
        pending = streamer.lookup(streamed_tokens, session=sid("streamed"), wait=False, expect=True)
        assert pending.pending and pending.expected_tokens == CHUNKS * CHUNK
        assert l1_client.lookup(l1_tokens, session=sid("l1-hit")).hit_tokens == CHUNKS * CHUNK
        os.kill(l2_server.proc.pid, signal.SIGSTOP)
        try:
            loader.submit(_job("streamed", streamed_tokens, streamed_ids, stream=True), streamed_ids)
            loader.submit(_job("l1-hit", l1_tokens, l1_ids, stream=False), l1_ids)
            done: list[tuple[Any, Any]] = []
            deadline = time.monotonic() + 60
            while not done and time.monotonic() < deadline:
                loader.wait_any(1.0)
                done = loader.take_done()
            assert [job.req_id for job, _ in done] == ["l1-hit"]
            assert done[0][1].ok and done[0][1].loaded_tokens == CHUNKS * CHUNK
            assert loader.loads_in_flight() == 1  # the streamed load still waits for its server
        finally:
            os.kill(l2_server.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 60
        while loader.loads_in_flight() and time.monotonic() < deadline:
            loader.wait_any(1.0)
            done += loader.take_done()
        streamed = [out for job, out in done if job.req_id == "streamed"]
        assert streamed and streamed[0].ok and streamed[0].loaded_tokens == CHUNKS * CHUNK
    finally:
        loader.close()
    assert_blocks_equal(dst, l1_ids, src, list(range(CHUNKS * BPC)))
    assert_blocks_equal(dst, streamed_ids, src, list(range(CHUNKS * BPC)))


def _job(name: str, tokens: np.ndarray, ids: list[int], stream: bool) -> LoadJob:
    n = len(tokens)
    return LoadJob(name, sid(name), tokens.tolist(), [ids], 0, n, "", background=True, stream=stream)
