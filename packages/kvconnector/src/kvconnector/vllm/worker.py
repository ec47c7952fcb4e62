"""Worker side of KVServerConnector: registers the paged KV, loads before the forward, saves after.

Loads are handed to a background thread (loader.py, async_loads, the default) and reported done in
`get_finished`, or run in `start_load_kv` (vLLM calls it before the forward when a step has connector
loads). Saves are planned in `wait_for_save`, after the whole forward, one EngineClient call per
request for all layers, and run on the same thread (async_saves, the default) or at once. The
per-layer hooks are no-ops: on CPU there is no copy engine to overlap with, and whole-step copies
are one batched kernel call each; on a GPU a request's copies run on the copier's side stream
(kvconnector._torch_copy), beside the forward of the engine's other requests.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvprotocol import LayoutDescriptor

from ..engine_kv import promised_block_ids, token_blocks
from .breaker import Breaker
from .calibrate import calibrate_load
from .config import ConnectorConfig
from .loader import BackgroundLoader, LoadOutcome, SaveOutcome, copy_job, save_job
from .log import log
from .metadata import KVServerConnectorMetadata, KVServerWorkerMetadata, LoadJob, SaveJob
from .stats import KVServerConnectorStats

if TYPE_CHECKING:
    import torch

    from ..engine_client import EngineClient

IDLE_WAIT_S = 0.002  # how long a step with nothing scheduled waits for a background load or save to end


class WorkerSide:
    def __init__(
        self,
        cfg: ConnectorConfig,
        client: EngineClient | None,
        expected: list[LayoutDescriptor] | None,
        load_client: EngineClient | None = None,
        save_client: EngineClient | None = None,
        stream_client: EngineClient | None = None,
    ) -> None:
        self.cfg = cfg
        self.client = client
        # async_loads/async_saves: background copies through clients of their own (see loader.py)
        self.loader = (
            BackgroundLoader(
                load_client,
                cfg.debug_load_delay_s,
                cfg.debug_save_delay_s,
                cfg.reserve_wait_s,
                save_client,
                cfg.debug_hold_saves_for_load,
                stream_client,
            )
            if load_client is not None
            else None
        )
        self.received: set[str] = set()  # background loads that ended without a copy (reported next poll)
        self.saving: dict[str, int] = {}  # req id -> background saves in flight (async_saves)
        self.save_reqs: set[str] = set()  # requests with saves whose blocks vLLM keeps until we say "sent"
        self.finishing: set[str] = set()  # of those, finished ones waiting for their saves
        self._step_t0: float | None = None  # perf_counter at bind_connector_metadata (costs.py samples)
        self._step_load_s = 0.0
        self.expected = expected
        self.layouts: list[LayoutDescriptor] = []
        self.layout: LayoutDescriptor | None = None  # group 0's (its block size is every group's)
        self.tensors: list[torch.Tensor] = []  # group 0's
        self.group_tensors: list[list[torch.Tensor]] = []
        self.enabled = client is not None
        self.failed_blocks: set[int] = set()
        self.failed_requests: set[str] = set()  # several groups: failed loads reported per request
        self.failed_reqs: set[str] = set()
        self.failed_epochs: dict[str, int] = {}  # req id -> highest LoadJob.epoch whose load failed
        self.report = KVServerWorkerMetadata()
        self._tails_told: bool | None = None  # what the scheduler was last told of the server's tails
        self._tails_started: KVServerConnectorMetadata | None = None  # its tail saves went at bind (start_tails)
        self.stats = KVServerConnectorStats()
        self.breaker = Breaker(cfg.retry_after_s)

    @property
    def kv(self) -> EngineClient:
        """The step's client; the copy and release paths run only on an enabled worker, which has one."""
        if self.client is None:
            raise RuntimeError("KVServerConnector worker has no EngineClient (disabled)")
        return self.client

    @property
    def multi_group(self) -> bool:
        return len(self.layouts) > 1

    def register(self, layouts: list[LayoutDescriptor], groups: list[list[torch.Tensor]]) -> None:
        """Adopt the KV tensors of every group (one list per KV cache group, layouts in that order)."""
        if self.expected is not None and [x.fingerprint for x in layouts] != [x.fingerprint for x in self.expected]:
            log.error(
                "KVServerConnector: worker KV layouts %s differ from the scheduler's %s; connector disabled",
                layouts,
                self.expected,
            )
            self.enabled = False
            return
        self.layouts = list(layouts)
        layout, tensors = layouts[0], groups[0]
        self.layout, self.tensors, self.group_tensors = layout, tensors, list(groups)
        kv = groups if self.multi_group else tensors  # EngineClient: a list per group, or one group's list
        if self.client is not None and not self.client.register(kv):
            log.error("KVServerConnector: the EngineClient rejected the KV tensors; connector disabled")
            self.enabled = False
            return
        if self.loader is not None and not all(c.register(kv) for c in self.loader.clients()):
            log.error("KVServerConnector: the loader's EngineClient rejected the KV tensors; loads run in the step")
            self.loader = None
        wants_rate = self.cfg.plan_loads or (self.cfg.async_loads and self.cfg.in_step_load_share > 0)
        if wants_rate and self.cfg.load and self.client is not None:
            cal = calibrate_load(self.client, tensors, layout)
            if cal is not None:  # the first load rates (planner, in-step loads)
                r = self.report
                r.load_fixed_s, r.loads, r.in_step_loads = cal.fixed_s, 1, 1
                r.load_tokens, r.load_s = r.in_step_tokens, r.in_step_s = cal.tokens, cal.seconds
                log.info(
                    "KVServerConnector worker: calibrated load %.0f us + %.2f us/token",
                    1e6 * cal.fixed_s,
                    1e6 * cal.copy_s / cal.tokens,
                )
        log.info(
            "KVServerConnector worker: registered %d layers, tensor layout %s, copier %s",
            sum(len(g) for g in groups),
            ",".join(x.fingerprint for x in layouts),
            getattr(self.client, "copier_name", None) or "none",
        )

    def start_load(self, meta: KVServerConnectorMetadata) -> None:
        self.failed_reqs.clear()
        for job in meta.loads:
            self._load(job)
        for req_id in meta.finished:
            self.failed_epochs.pop(req_id, None)

    def step_started(self) -> None:
        self._step_t0 = time.perf_counter()
        self._step_load_s = 0.0

    def _step_ended(self, meta: KVServerConnectorMetadata) -> None:
        """The forward's cost (without the loads run in the step), a sample of the prefill rate."""
        if self._step_t0 is not None and meta.scheduled_tokens:
            self.report.step_tokens += meta.scheduled_tokens
            self.report.step_s += max(0.0, time.perf_counter() - self._step_t0 - self._step_load_s)
        self._step_t0 = None

    def start_tails(self, meta: KVServerConnectorMetadata) -> None:
        """Save the step's tails before the forward (vLLM binds the metadata first): in the step where
        the KV is in host memory, else on the save thread.

        Their requests have finished: the blocks are complete and no forward writes them, and vLLM
        keeps them until the tails are saved. On a CPU engine's save thread a tail waits for the GIL
        and the other requests' saves, and was measured to keep its blocks steps longer; saved here
        (at most a chunk each), `get_finished` frees them at the end of this very step, so on an
        engine whose KV cache holds a few requests a waiting request gets them sooner. On a GPU the
        copy would wait for the forward still running (asynchronous scheduling), so tails go to the
        save thread there, as does a tail whose request still has a chunk save in flight: the server
        stores a tail only after the chunk it extends."""
        if not (self.enabled and self.cfg.async_saves and self.loader is not None and self.cfg.save_policy != "none"):
            return
        tails = [job for job in meta.saves if job.tail]
        busy = set(self.saving)
        host = bool(self.tensors) and self.tensors[0].device.type == "cpu"
        for job in tails:
            self._save_one(job, in_step=host and job.req_id not in busy)
        self.stats.add("tails_before_forward", len(tails))
        self._tails_started = meta

    def save(self, meta: KVServerConnectorMetadata) -> None:
        self._step_ended(meta)
        started, self._tails_started = self._tails_started is meta, None
        if not self.enabled or self.cfg.save_policy == "none":
            return
        for job in meta.saves:
            if not (started and job.tail):
                self._save_one(job)

    def _save_one(self, job: SaveJob, in_step: bool = False) -> None:
        """Check one save (unsafe after a failed load, server down) and run it (`in_step`, or without
        async_saves) or submit it to the save thread."""
        if self.cfg.async_saves:
            self.save_reqs.add(job.req_id)  # the scheduler delays freeing its blocks (request_finished)
        if job.req_id in self.failed_reqs or job.epoch <= self.failed_epochs.get(job.req_id, -1):
            # Computed over blocks that failed to load, in this step or in one planned before the
            # scheduler heard of the failure (async scheduling): never store that.
            self.stats.add("unsafe_saves_dropped")
            self._save_failed(job.req_id, job.skip_tokens)
            return
        if not self.breaker.allow():
            self.stats.add("skipped_server_down")
            self._save_failed(job.req_id, job.skip_tokens)
            return
        if self.loader is not None and self.cfg.async_saves and not in_step:
            self.loader.submit_save(job)
            self.saving[job.req_id] = self.saving.get(job.req_id, 0) + 1
            return
        self._finish_save(job, save_job(self.kv, job, reserve_wait_s=self.cfg.reserve_wait_s))

    def _finish_save(self, job: SaveJob, out: SaveOutcome) -> None:
        self.stats.add("save_s", out.seconds)
        self.stats.add("saves")
        self.stats.add("saved_chunks", out.chunks)
        if out.ok:
            self.breaker.succeeded()
            end = len(job.tokens)
            self.report.saved[job.req_id] = min(end, self.report.saved.get(job.req_id, end))
        elif out.no_space:
            # A full cache (every object leased or being written): what fitted is stored, the
            # server works, so no breaker. The rest of the request is not known stored.
            self.breaker.succeeded()
            self.stats.add("partial_saves" if out.chunks else "no_space_saves")
            self._save_failed(job.req_id, job.skip_tokens)
            log.debug("KVServerConnector: save incomplete, cache full (%s)", out.error)
        else:
            self.stats.add("save_errors")
            self._save_failed(job.req_id, job.skip_tokens)
            log.warning("KVServerConnector: save failed (%s)", out.error)
            self.breaker.failed()

    def _save_failed(self, req_id: str, skip_tokens: int) -> None:
        self.report.save_failed[req_id] = min(skip_tokens, self.report.save_failed.get(req_id, skip_tokens))

    def take_report(self) -> KVServerWorkerMetadata | None:
        tails = self.client.tails if self.client is not None and self.enabled else None
        if tails is not None and tails != self._tails_told:  # the scheduler looks up with tails only then
            self.report.tails = self._tails_told = tails
        if self.report.is_empty():
            return None
        out, self.report = self.report, KVServerWorkerMetadata()
        return out

    def take_failed_blocks(self) -> set[int]:
        out, self.failed_blocks = self.failed_blocks, set()
        return out

    def take_failed_requests(self) -> set[str]:
        out, self.failed_requests = self.failed_requests, set()
        return out

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
        if self.client is not None:
            self.client.close()

    # --- internals ------------------------------------------------------------------------
    def _load(self, job: LoadJob) -> None:
        wanted = self._promised(job)
        if not self.enabled or self.layout is None or job.fail:
            self._release(job.session)
            self._fail(job, wanted, job.fail or "connector disabled on this worker")
            if job.background:
                self.received.add(job.req_id)
            return
        if job.background and self.loader is not None:
            if job.stream and self.loader.stream_client is not None:
                self.stats.add("loads_streamed_apart")
            self.loader.submit(job, wanted)
            return
        outcome = copy_job(self.kv, job, wanted, self.cfg.debug_load_delay_s)
        self._finish_load(job, wanted, outcome)
        if job.background:  # no loader thread on this worker: loaded in the step, reported next poll
            self.received.add(job.req_id)

    def get_finished(self, scheduled_tokens: int, finished: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(sent, received): finished requests whose background saves all ended (vLLM frees their
        blocks now), and requests whose background load ended (ok or failed: failures are in the
        failed blocks vLLM collects right after this call). Counts forward steps run during loads."""
        if self.loader is not None and self.loader.in_flight():
            if scheduled_tokens:
                if self.loader.loads_in_flight():
                    self.stats.add("steps_during_loads")
            else:
                # Nothing to compute, yet vLLM steps again at once: to poll a load, or because a finished
                # request holds its blocks until its saves end. That loop spins a core (on 2 cores, the
                # other engine's) and holds the GIL the copy threads need: a 3 ms load took 90 ms beside
                # it. Waiting here yields both; it ends as soon as a copy does.
                self.stats.add("idle_waits")
                self.loader.wait_any(IDLE_WAIT_S)
        done = self.loader.take_done() if self.loader is not None else []
        if self.loader is not None:
            self.stats.add("loads_past_saves", self.loader.take_loads_past_saves())
        for job, outcome in done:
            if isinstance(job, SaveJob):
                self.saving[job.req_id] -= 1
                if not self.saving[job.req_id]:
                    del self.saving[job.req_id]
                self._finish_save(job, outcome)
                continue
            self._finish_load(job, self._promised(job), outcome)
            self.received.add(job.req_id)
        self.finishing |= finished & self.save_reqs
        sent = {r for r in self.finishing if r not in self.saving}
        self.finishing -= sent
        self.save_reqs -= sent
        self.stats.add("finished_held_steps", len(self.finishing))  # blocks vLLM keeps another step
        out, self.received = self.received, set()
        return sent or None, out or None

    def drain_saves(self, preempted: bool) -> None:
        """A preempted request's blocks are free for reuse in this very step: finish saves first."""
        if preempted and self.loader is not None and self.saving:
            self.loader.wait_saves()
            self.stats.add("save_drains")

    def _promised(self, job: LoadJob) -> list[int]:
        """Group 0's blocks of the load's range, reported failed when the client could not name the
        blocks (engine_kv.promised_block_ids). Unregistered, block ids are taken one per token."""
        return promised_block_ids(job.block_ids[0], self._block_size, job.skip_tokens, job.num_tokens)

    @property
    def _block_size(self) -> int:
        return self.layout.block_size if self.layout else 1

    def _finish_load(self, job: LoadJob, wanted: list[int], outcome: LoadOutcome) -> None:
        self.stats.add("verify_failures", outcome.verify_failures)
        self.stats.add("load_s", outcome.seconds)
        self.stats.add("loads")
        ok, err, bad = outcome.ok, outcome.error, list(outcome.failed_block_ids)
        if ok and not bad and self.cfg.debug_fail_load_chunks:
            bad = self._inject_failure(job)
            ok = not bad
            err = "debug_fail_load_chunks"
        if ok and not bad:
            # the tokens vLLM takes from the load: a load may copy past them to the end of a block
            # (a chunk's, or a tail's) that vLLM computes over
            taken = outcome.loaded_tokens
            if job.compute_from > job.skip_tokens:
                taken = min(taken, job.compute_from - job.skip_tokens)
            self.stats.add("loaded_tokens", taken)
            self.report.loads += 1
            self.report.load_tokens += outcome.loaded_tokens
            self.report.load_s += outcome.seconds
            if not job.background:
                self._step_load_s += outcome.seconds
                self.report.in_step_loads += 1
                self.report.in_step_tokens += outcome.loaded_tokens
                self.report.in_step_s += outcome.seconds
            self.breaker.succeeded()
            return
        self._fail(job, bad or wanted, err or "load failed")

    def _fail(self, job: LoadJob, blocks: list[int], err: str) -> None:
        self.stats.add("load_errors")
        self.stats.add("failed_blocks", len(blocks))
        if self.multi_group:  # vLLM maps no block ids back to requests then: it recomputes the request
            self.failed_requests.add(job.req_id)
        else:
            self.failed_blocks.update(blocks)
        self.failed_reqs.add(job.req_id)
        self.failed_epochs[job.req_id] = max(job.epoch, self.failed_epochs.get(job.req_id, -1))
        bs = self._block_size
        pos = {b: i for i, b in enumerate(job.block_ids[0])}
        first = min((pos[b] * bs for b in blocks if b in pos), default=job.skip_tokens)
        if self.multi_group:  # the whole load is lost (vLLM recomputes the request)
            first = job.skip_tokens
        self.report.load_failed[job.req_id] = first
        log.warning("KVServerConnector: load of %d blocks failed (%s); vLLM recomputes them", len(blocks), err)

    def _inject_failure(self, job: LoadJob) -> list[int]:
        """TEST ONLY: overwrite the loaded blocks of the configured chunks with garbage and report them."""
        assert self.layout is not None
        # several groups: the first full-attention one (a sliding group's table holds vLLM's null block)
        g = next((i for i, lay in enumerate(self.layouts) if lay.kind == "full"), 0) if self.multi_group else 0
        bpc = self.layouts[g].blocks_per_chunk
        first, end = token_blocks(job.skip_tokens, job.num_tokens, self.layout.block_size)
        bad = [
            b
            for j, b in enumerate(job.block_ids[g][:end])
            if j >= first and j // bpc in self.cfg.debug_fail_load_chunks
        ]
        for t in self.group_tensors[g]:
            for b in bad:
                t[b].fill_(1.0e4)
        return bad

    def _release(self, session: str) -> None:
        """Give back this rank's leases only: the other ranks may still be copying theirs."""
        try:
            self.kv.release(session, rank=self.kv.rank)
        except Exception as exc:  # noqa: BLE001
            log.debug("KVServerConnector: release failed: %s", exc)
