"""Scheduler side of KVServerConnector: each request's life; the lookup path is lookups.py's, the
per-step load/save plan step_plan.py's, the per-request state request_state.py's.

Per request it remembers the hit it announced, the blocks vLLM gave the request, and how far the
request's chunks are known to be stored, so each step's metadata names exactly the blocks to load
(before the forward) and the newly completed chunks to store (after it).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvprotocol import new_session_id

from . import plan
from .breaker import Breaker
from .config import ConnectorConfig
from .costs import CostModel
from .extra_keys import AdapterDigests, request_keys
from .local_loads import LocalLoads, prefix_digests
from .log import log
from .lookups import LookupSide
from .lookup_wait import LookupWait
from .metadata import KVServerConnectorMetadata, KVServerWorkerMetadata, SaveJob
from .request_state import ReqState
from .stats import KVServerConnectorStats
from .tails import tail_saves
from .step_plan import StepPlanner

ANNOUNCE_MIN_S = 0.25  # the shortest announcement: the forward's estimate, plus the save after it

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from ..engine_client import EngineClient


class SchedulerSide(LookupSide):
    def __init__(
        self,
        cfg: ConnectorConfig,
        client: EngineClient | None,
        block_size: int,
        num_groups: int = 1,
        prefix_caching: bool = True,
        exact: bool = False,
        align_tails: bool = False,
    ) -> None:
        self.cfg = cfg
        self.client = client
        self.block_size = block_size
        # Several KV cache groups (vLLM's hybrid manager): vLLM takes load failures only per request
        # (failed_recving of an asynchronous load), never as block ids, so every load is asynchronous.
        self.async_loads = cfg.async_loads or num_groups > 1
        self.multi_group = num_groups > 1
        # a streamed L2 hit is loaded while it lands: only by a background load (vLLM waits for it)
        self.stream_l2 = cfg.stream_l2 and self.async_loads and not cfg.wait_for_l2
        self.chunk = cfg.chunk_size
        self.reqs: dict[str, ReqState] = {}
        self.stats = KVServerConnectorStats()
        self.breaker = Breaker(cfg.retry_after_s)
        self.adapters = AdapterDigests()
        self.costs = CostModel.new()  # load vs recompute (plan_loads)
        self._async: list[str] = []  # requests whose asynchronous load the next metadata carries
        self.parked: set[str] = set()  # requests vLLM parks until their background load ends
        # asynchronous loads in flight by the prefix they bring (a request needing it waits for it)
        self.local_loads = LocalLoads()
        self.share_loads = cfg.share_loads and prefix_caching and self.async_loads
        self.steps = StepPlanner(cfg, client is not None, block_size, self._extra, exact)
        self.wait = LookupWait(
            cfg.lookup_wait_s, cfg.lookup_wait_step_share, cfg.lookup_wait_max_s, cfg.lookup_wait_idle_s
        )
        self.running: set[str] = set()  # scheduled in the last step and not finished since
        # tails (a partial last chunk's KV): the workers say whether their server takes them
        self.server_tails = False
        self.align_tails = align_tails  # a tail hit ends on a block boundary (vLLM's async scheduling)
        self.tail_saves: list[SaveJob] = []  # finished requests' tails, for the next step's workers

    # --- vLLM hooks (get_num_new_matched_tokens: lookups.py) ---------------------------------
    def update_state_after_alloc(
        self, request: Request, num_external_tokens: int, block_ids: list[list[int]] | None = None
    ) -> None:
        """With async_loads, vLLM parks the request until its load ends: the load is planned from the
        blocks allocated here (the request is not among the next step's scheduled ones); vLLM calls
        this again with 0 external tokens once the load is done."""
        self.running.add(request.request_id)  # the step now runs something: later lookups wait as when busy
        st = self.reqs.get(request.request_id)
        if st is None:
            return
        st.hit_answer = None  # scheduled: a later call (after a preemption) asks the server again
        st.external_tokens = num_external_tokens
        st.load_pending = num_external_tokens > 0
        if num_external_tokens > 0:
            st.l2_tokens = self.hit_sources(request, num_external_tokens).get("l2", 0)
            if st.background and block_ids is not None:
                st.block_ids = [list(b) for b in block_ids]
                self._async.append(st.req_id)
                self.parked.add(st.req_id)
                if self.share_loads and st.request is not None:
                    end = plan.load_end(
                        st.local_computed, num_external_tokens, self.chunk, st.hit_tokens, self.block_size
                    )
                    first, last = st.local_computed // self.chunk, end // self.chunk
                    tokens, extra = st.request.all_token_ids, self._extra(st, end)
                    self.local_loads.add(st.req_id, prefix_digests(tokens, st.salt, extra, self.chunk, first, last))
        if num_external_tokens > 0:
            self.stats.add("external_tokens", num_external_tokens)
            if not st.background:
                self.stats.add("loads_in_step")
        else:
            self._release(st)

    def build_connector_meta(self, so: SchedulerOutput) -> KVServerConnectorMetadata:
        meta = KVServerConnectorMetadata(
            scheduled_tokens=int(getattr(so, "total_num_scheduled_tokens", 0) or 0),
            preempted=bool(getattr(so, "preempted_req_ids", None)),
        )
        meta.saves.extend(self.tail_saves)  # their requests ended: vLLM keeps the blocks until they are saved
        self.tail_saves.clear()
        self.wait.step(time.monotonic(), meta.scheduled_tokens > 0)
        if not meta.scheduled_tokens:
            self.stats.add("empty_steps")
        self.stats.add("parked_steps", len(self.parked))
        for req_id in self._async:  # loads vLLM is waiting for (WAITING_FOR_REMOTE_KVS)
            st = self.reqs.get(req_id)
            if st is not None and st.load_pending:
                self.steps.plan_load(meta, st, None, background=True)
        self._async.clear()
        for new in so.scheduled_new_reqs:
            st = self.reqs.get(new.req_id)
            if st is None:  # never looked up (should not happen): without its Request, its keys are
                st = self._new_state(new.req_id, None, None)  # unknown: never saved
            st.block_ids = [list(b) for b in new.block_ids]
            st.miss_until = 0.0  # scheduled: a later call (after a preemption) asks the server again
            self.steps.plan(
                meta, st, int(new.num_computed_tokens), so.num_scheduled_tokens.get(new.req_id, 0), new.prompt_token_ids
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.reqs.get(req_id)
            if st is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = [list(b) for b in new_blocks] if new_blocks is not None else []
            elif new_blocks is not None and len(new_blocks) == len(st.block_ids):
                for mine, new_ids in zip(st.block_ids, new_blocks, strict=True):
                    mine.extend(new_ids)
            elif new_blocks is not None:  # a table we never saw begin: its positions are unknown
                st.block_ids = []  # nothing of it is loaded or saved from now on (step_plan.covers)
            self.steps.plan(meta, st, int(cached.num_computed_tokens[i]), so.num_scheduled_tokens.get(req_id, 0), None)
        self._announce(meta)
        meta.finished = list(getattr(so, "finished_req_ids", ()) or ())
        self.running = {new.req_id for new in so.scheduled_new_reqs} | set(cached.req_ids)
        self.running.difference_update(meta.finished)
        return meta

    def update_connector_output(
        self, report: KVConnectorWorkerMetadata | None, finished_recving: Iterable[str] = ()
    ) -> None:
        """What the workers stored, and where loads failed (those chunks get stored again later).

        `report` is vLLM's aggregated worker metadata: ours, or None on a step without any;
        `finished_recving`: the requests whose asynchronous load ended (ok or failed).
        A failed save is not retried: a store is best effort, and a dead server must not cost a
        retry every step. The request simply misses next time.
        """
        for req_id in finished_recving:
            self.local_loads.done(req_id)
            self.parked.discard(req_id)
        if not isinstance(report, KVServerWorkerMetadata):
            return
        r, costs = report, self.costs
        if r.tails is not None:
            self.server_tails = r.tails
        costs.calibrated(r.load_fixed_s)
        costs.observe_loads(r.loads, r.load_tokens, r.load_s, in_step=False)
        costs.observe_loads(r.in_step_loads, r.in_step_tokens, r.in_step_s, in_step=True)
        costs.observe_prefill(r.step_tokens, r.step_s)
        failed_saves = report.save_failed
        for req_id, end in report.saved.items():
            st = self.reqs.get(req_id)
            if st is not None and req_id not in failed_saves:
                st.stored = max(st.stored, end)
        for req_id, pos in report.load_failed.items():
            st = self.reqs.get(req_id)
            if st is not None:
                st.load_failed = True
                st.epoch += 1  # saves planned from now on are over recomputed blocks
                st.loaded_tokens = max(0, min(st.loaded_tokens, pos - st.local_computed))
                st.saved_upto = min(st.saved_upto, plan.floor_to(pos, self.chunk))
                st.stored = min(st.stored, plan.floor_to(pos, self.chunk))

    def request_finished_delay(self, request: Request) -> tuple[bool, dict[str, object] | None]:
        """(keep the blocks until the workers' saves end, kv_transfer_params)."""
        st = self.reqs.get(request.request_id)
        if st is not None:
            self._save_tail(st, request)
        delay = bool(st is not None and st.had_saves and self.cfg.async_saves)
        return delay, self.request_finished(request)

    def request_finished(self, request: Request) -> dict[str, object] | None:
        self.running.discard(request.request_id)
        st = self.reqs.pop(request.request_id, None)
        if st is None:
            return None
        self.local_loads.done(st.req_id)
        self.parked.discard(st.req_id)
        if st.lookup_rid is not None and self.client is not None:  # aborted while its lookup was on its way
            self.client.lookup_forget(st.lookup_rid)
            st.leased = True  # what that lookup leases is released right after it
        self._release(st)
        return {
            "kvserver": {
                "hit_tokens": st.hit_tokens,
                "loaded_tokens": st.loaded_tokens,
                "l2_tokens": min(st.l2_tokens, st.loaded_tokens),
                "load_failed": st.load_failed,
                "stored_tokens": st.stored,
            }
        }

    def close(self) -> None:
        for st in self.reqs.values():
            self._release(st)
        self.reqs.clear()
        if self.client is not None:
            self.client.close()

    # --- internals ------------------------------------------------------------------------
    def _announce(self, meta: KVServerConnectorMetadata) -> None:
        """Tell the server which chunks this step computes and will save (before the forward), so
        another engine's lookup of them waits instead of computing them too. The announcement lasts
        twice this step's estimated prefill plus ANNOUNCE_MIN_S, at most announce_max_s."""
        client, cap = self.client, self.cfg.announce_max_s
        if client is None or cap <= 0 or not meta.saves or not self.breaker.up:
            return  # (a server that failed since its last answer is not told anything until it answers)
        rate = self.costs.prefill.s_per_token
        guess = cap if rate is None else 2 * rate * meta.scheduled_tokens + ANNOUNCE_MIN_S
        ttl = max(min(ANNOUNCE_MIN_S, cap), min(cap, guess))
        for job in meta.saves:
            st = self.reqs.get(job.req_id)
            if st is None or len(job.tokens) < job.skip_tokens + self.chunk:
                continue
            first = job.skip_tokens // self.chunk
            client.announce(job.tokens, first, ttl, session=st.session, salt=job.salt, extra=job.extra)
            self.stats.add("announced_chunks", len(job.tokens) // self.chunk - first)

    def _save_tail(self, st: ReqState, request: Request) -> None:
        """A finished request's tail, saved by the next step's workers (tails.py)."""
        if not (self.tails and self.cfg.async_saves and self.client is not None):
            return
        jobs = tail_saves(st, request, self.cfg.save_policy, self.chunk, self.block_size, self._extra)
        if jobs:
            st.had_saves = True  # vLLM keeps the blocks until the workers have saved them
            self.tail_saves.extend(jobs)
            self.stats.add("tail_saves", len(jobs))

    def _extra(self, st: ReqState, num_tokens: int) -> tuple[tuple[int, bytes], ...]:
        if st.request is None:
            return ()
        keys = request_keys(st.request, num_tokens, self.chunk, self.adapters)
        return keys.extra

    def _state(self, request: Request) -> ReqState:
        st = self.reqs.get(request.request_id)
        if st is None:
            st = self._new_state(request.request_id, request, getattr(request, "cache_salt", None))
        st.request = request
        return st

    def _check_cacheable(self, st: ReqState, request: Request | None) -> None:
        if request is None:
            st.cacheable = False
            return
        keys = request_keys(request, 0, self.chunk, self.adapters)
        if not keys.cacheable:
            st.cacheable = False
            self.stats.add("uncacheable_requests")
            log.debug("KVServerConnector: request %s is not cached (%s)", st.req_id, keys.reason)

    def _new_state(self, req_id: str, request: Request | None, cache_salt: str | None) -> ReqState:
        st = ReqState(
            req_id=req_id, request=request, salt=plan.key_salt(cache_salt), session=new_session_id()
        )  # 128 random bits: the server refuses guessable ids
        self.reqs[req_id] = st
        self._check_cacheable(st, request)
        return st

    def _release(self, st: ReqState) -> None:
        st.hit_answer = None  # without its leases a hit's answer stands no more
        if not st.leased or self.client is None:
            return
        st.leased = False
        self.client.release(st.session, wait=False)  # ordered after the lookups; the answer is not awaited

    def _failed(self, op: str, err: str) -> None:
        log.warning("KVServerConnector: %s failed (%s); recomputing, retrying the server later", op, err)
        self.breaker.failed()
