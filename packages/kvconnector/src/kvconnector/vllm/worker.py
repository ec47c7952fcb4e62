"""Worker side of KVServerConnector: registers the paged KV, loads before the forward, saves after.

Loads are synchronous in `start_load_kv` (vLLM calls it before the forward when a step has
connector loads); saves run in `wait_for_save`, after the whole forward, one EngineClient call per
request for all layers. The per-layer hooks are no-ops: on CPU there is no copy engine to overlap
with, and whole-step copies are one batched kernel call each.
"""

from __future__ import annotations

import time
from typing import Any

from kvprotocol import LayoutDescriptor

from .breaker import Breaker
from .config import ConnectorConfig
from .log import log
from .metadata import KVServerConnectorMetadata, KVServerWorkerMetadata, LoadJob
from .stats import KVServerConnectorStats


class WorkerSide:
    def __init__(self, cfg: ConnectorConfig, client: Any, expected: LayoutDescriptor | None) -> None:
        self.cfg = cfg
        self.client = client
        self.expected = expected
        self.layout: LayoutDescriptor | None = None
        self.tensors: list[Any] = []
        self.enabled = client is not None
        self.failed_blocks: set[int] = set()
        self.failed_reqs: set[str] = set()
        self.failed_epochs: dict[str, int] = {}  # req id -> highest LoadJob.epoch whose load failed
        self.report = KVServerWorkerMetadata()
        self.stats = KVServerConnectorStats()
        self.breaker = Breaker(cfg.retry_after_s)

    def register(self, layout: LayoutDescriptor, tensors: list[Any]) -> None:
        if self.expected is not None and layout.fingerprint != self.expected.fingerprint:
            log.error("KVServerConnector: worker KV layout %s differs from the scheduler's %s; "
                      "connector disabled", layout, self.expected)
            self.enabled = False
            return
        self.layout, self.tensors = layout, tensors
        if self.client is not None and not self.client.register(tensors):
            log.error("KVServerConnector: the EngineClient rejected the KV tensors; connector disabled")
            self.enabled = False
            return
        log.info("KVServerConnector worker: registered %d layers, tensor layout %s", len(tensors),
                 layout.fingerprint)

    def start_load(self, meta: KVServerConnectorMetadata) -> None:
        self.failed_reqs.clear()
        for job in meta.loads:
            self._load(job)
        for req_id in meta.finished:
            self.failed_epochs.pop(req_id, None)

    def save(self, meta: KVServerConnectorMetadata) -> None:
        if not self.enabled or self.cfg.save_policy == "none":
            return
        for job in meta.saves:
            if job.req_id in self.failed_reqs or job.epoch <= self.failed_epochs.get(job.req_id, -1):
                # Computed over blocks that failed to load, in this step or in one planned before the
                # scheduler heard of the failure (async scheduling): never store that.
                self.stats.add("unsafe_saves_dropped")
                self._save_failed(job.req_id, job.skip_tokens)
                continue
            if not self.breaker.allow():
                self.stats.add("skipped_server_down")
                self._save_failed(job.req_id, job.skip_tokens)
                continue
            t = time.perf_counter()
            try:
                res = self.client.save(job.tokens, job.block_ids, salt=job.salt, skip_tokens=job.skip_tokens,
                                       extra=job.extra)
                ok, err, chunks = res.ok, res.error, res.saved_chunks
            except Exception as exc:  # noqa: BLE001 - a failed store is a future miss, never an engine error
                ok, err, chunks = False, f"{type(exc).__name__}: {exc}", 0
            self.stats.add("save_s", time.perf_counter() - t)
            self.stats.add("saves")
            self.stats.add("saved_chunks", chunks)
            if ok:
                self.breaker.succeeded()
                end = len(job.tokens)
                self.report.saved[job.req_id] = min(end, self.report.saved.get(job.req_id, end))
            else:
                self.stats.add("save_errors")
                self._save_failed(job.req_id, job.skip_tokens)
                log.warning("KVServerConnector: save failed (%s)", err)
                self.breaker.failed()

    def _save_failed(self, req_id: str, skip_tokens: int) -> None:
        self.report.save_failed[req_id] = min(skip_tokens, self.report.save_failed.get(req_id, skip_tokens))

    def take_report(self) -> KVServerWorkerMetadata | None:
        if self.report.is_empty():
            return None
        out, self.report = self.report, KVServerWorkerMetadata()
        return out

    def take_failed_blocks(self) -> set[int]:
        out, self.failed_blocks = self.failed_blocks, set()
        return out

    def close(self) -> None:
        if self.client is not None:
            self.client.close()

    # --- internals ------------------------------------------------------------------------
    def _load(self, job: LoadJob) -> None:
        bs = self.layout.block_size if self.layout else 1
        wanted = list(job.block_ids[job.skip_tokens // bs: job.num_tokens // bs])
        if not self.enabled or self.layout is None or job.fail:
            self._release(job.session)
            self._fail(job, wanted, job.fail or "connector disabled on this worker")
            return
        t = time.perf_counter()
        verify_before = self.client.verify_failures
        try:
            res = self.client.load(job.session, job.tokens, job.block_ids, skip_tokens=job.skip_tokens,
                                   num_tokens=self._load_end(job), salt=job.salt, extra=job.extra)
            ok, err, bad, loaded = res.ok, res.error, list(res.failed_block_ids), res.loaded_tokens
        except Exception as exc:  # noqa: BLE001 - load already gave this rank's leases back
            ok, err, bad, loaded = False, f"{type(exc).__name__}: {exc}", wanted, 0
        self.stats.add("verify_failures", self.client.verify_failures - verify_before)
        self.stats.add("load_s", time.perf_counter() - t)
        self.stats.add("loads")
        if ok and not bad and self.cfg.debug_fail_load_chunks:
            bad = self._inject_failure(job)
            ok = not bad
            err = "debug_fail_load_chunks"
        if ok and not bad:
            self.stats.add("loaded_tokens", loaded)
            self.breaker.succeeded()
            return
        self._fail(job, bad or wanted, err or "load failed")

    def _load_end(self, job: LoadJob) -> int:
        """Where the load ends: the chunk end, or for a sliding window exactly the first token vLLM
        computes, so the window written is the one vLLM attends to (never a block it nulled)."""
        if self.layout is not None and self.layout.kind == "sliding" and job.compute_from > job.skip_tokens:
            return min(job.compute_from, job.num_tokens)
        return job.num_tokens

    def _fail(self, job: LoadJob, blocks: list[int], err: str) -> None:
        self.stats.add("load_errors")
        self.stats.add("failed_blocks", len(blocks))
        self.failed_blocks.update(blocks)
        self.failed_reqs.add(job.req_id)
        self.failed_epochs[job.req_id] = max(job.epoch, self.failed_epochs.get(job.req_id, -1))
        bs = self.layout.block_size if self.layout else 1
        pos = {b: i for i, b in enumerate(job.block_ids)}
        first = min((pos[b] * bs for b in blocks if b in pos), default=job.skip_tokens)
        self.report.load_failed[job.req_id] = first
        log.warning("KVServerConnector: load of %d blocks failed (%s); vLLM recomputes them", len(blocks), err)

    def _inject_failure(self, job: LoadJob) -> list[int]:
        """TEST ONLY: overwrite the loaded blocks of the configured chunks with garbage and report them."""
        assert self.layout is not None
        bs, bpc = self.layout.block_size, self.layout.blocks_per_chunk
        first = job.skip_tokens // bs
        bad = [b for j, b in enumerate(job.block_ids[: job.num_tokens // bs])
               if j >= first and j // bpc in self.cfg.debug_fail_load_chunks]
        for t in self.tensors:
            for b in bad:
                t[b].fill_(1.0e4)
        return bad

    def _release(self, session: str) -> None:
        """Give back this rank's leases only: the other ranks may still be copying theirs."""
        try:
            self.client.release(session, rank=self.client.rank)
        except Exception as exc:  # noqa: BLE001
            log.debug("KVServerConnector: release failed: %s", exc)
