"""Scheduler side of KVServerConnector: lookups and each request's life; the per-step load/save
plan is step_plan.py's, the per-request state request_state.py's.

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
from .._results import LookupResult
from .log import log
from .lookup_wait import LookupWait
from .metadata import KVServerConnectorMetadata, KVServerWorkerMetadata, SaveJob
from .request_state import ReqState
from .stats import KVServerConnectorStats
from .tails import tail_saves
from .step_plan import StepPlanner

INFLIGHT_POLL_S = 0.01  # after an `inflight` answer, ask the server again no sooner than this
ANNOUNCE_MIN_S = 0.25  # the shortest announcement: the forward's estimate, plus the save after it

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from ..engine_client import EngineClient


class SchedulerSide:
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

    # --- vLLM hooks -------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request)
        reused = self._reused_hit(st, request, num_computed_tokens)
        if reused is not None:
            return reused
        self._release(st)  # a repeated call (the request could not be scheduled) leases afresh
        if st.load_failed:
            # A load of this request failed (a corrupt object, a lost lease). vLLM asks again after an
            # asynchronous load that left nothing valid, and the same load would fail again, for
            # ever: recompute the rest instead (the first answer stays in hit_tokens).
            st.external_tokens, st.load_pending = 0, False
            return 0, False
        st.hit_tokens = st.external_tokens = 0
        st.load_pending = st.stream = st.background = False
        st.local_computed = num_computed_tokens
        if st.pending_since is None:  # a fresh lookup, not the next round of an "ask again later"
            st.l1_hit = None
        n = int(request.num_tokens)
        if not st.cacheable or n <= self.chunk or self.client is None or not self.cfg.load:
            return 0, False  # kv_producer: saves only
        if not self.breaker.allow():
            self.stats.add("skipped_server_down")
            return 0, False
        if st.miss_n == n and time.monotonic() < st.miss_until:
            # vLLM could not schedule the request after a lookup that found nothing: that answer
            # stands for lookup_miss_reuse_s (a new round trip could cost it another step)
            self.stats.add("lookups_reused")
            return 0, False
        if st.lookup_rid is None and self._wait_for_local_load(st, num_computed_tokens, n):
            return None, False  # before any lookup: no round trip while another load brings the prefix
        if st.lookup_rid is None and not self._may_ask(st):
            return None, False  # the prefix is being computed elsewhere: asked again shortly
        try:
            res = self._lookup(st, request, n)
        except Exception as exc:  # noqa: BLE001 - the engine must never fail because of the cache
            st.lookup_rid = None
            res = LookupResult(0, f"{type(exc).__name__}: {exc}")
        if res is None:
            self.stats.add("lookups_deferred")  # the answer is on its way: vLLM asks again next step
            return None, False
        err = res.error
        if err is not None:
            self._failed("lookup", err)
            self.stats.add("lookup_errors")
            return 0, False
        self.breaker.succeeded()
        hit = int(res.hit_tokens)
        st.leased = hit > 0  # a lookup that hits nothing leaves no session: one round trip fewer per miss
        if st.lookup_tails and hit % self.chunk:  # the hit ends in a stored tail, inside a chunk
            hit = plan.floor_to(min(hit, n), self.block_size) if self.align_tails else min(hit, n)
            self.stats.add("tail_hits")
        else:
            hit = min(plan.floor_to(hit, self.chunk), plan.floor_to(n, self.chunk))
        # the chunk the server's hit stops at is being written or computed elsewhere; unless this
        # engine's own prefix cache holds it already (another request of this engine computed it)
        inflight = res.inflight and int(res.hit_tokens) + self.chunk > num_computed_tokens
        if inflight and self._may_wait(st, self.cfg.inflight_wait_s):
            # A producer is still writing this prefix (PD disaggregation), or another engine announced
            # it computes it now: ask again later rather than compute what is about to arrive; after
            # inflight_wait_s (or once the announcement lapses), compute.
            self._release(st)
            self.stats.add("lookups_inflight")
            st.ask_after = time.monotonic() + INFLIGHT_POLL_S
            return None, False
        expected = res.expected_tokens if res.pending else None
        if expected is not None and self._may_wait(st):
            # The server located the rest in L2 and is bringing it into L1: report the whole hit now;
            # the worker's background load copies chunks as they land (a chunk that never lands is a
            # failed load: vLLM recomputes it). A prefetch that found nothing more leaves the L1 hit.
            st.l1_hit = hit if st.l1_hit is None else min(st.l1_hit, hit)
            grown = min(plan.floor_to(expected, self.chunk), plan.floor_to(n, self.chunk))
            if grown > hit:
                hit, st.stream, st.leased = grown, True, True
                self.stats.add("lookups_streamed")
        elif res.pending and self._may_wait(st):
            # The server prefetches the rest from L2: never block the scheduler on it. vLLM skips the
            # request this step and asks again; the leases taken now are given back at once.
            st.l1_hit = hit if st.l1_hit is None else min(st.l1_hit, hit)
            self._release(st)
            self.stats.add("lookups_pending")
            return None, False
        st.pending_since = None
        if hit == 0 and self.cfg.lookup_miss_reuse_s > 0:
            st.miss_n, st.miss_until = n, time.monotonic() + self.cfg.lookup_miss_reuse_s
        self.stats.add("lookup_tokens", n)
        st.hit_tokens = hit
        st.saved_upto = max(st.saved_upto, plan.floor_to(hit, self.chunk))  # those chunks are on the server already
        st.stored = max(st.stored, plan.floor_to(hit, self.chunk))
        self.stats.add("hit_tokens", hit)
        ext = plan.usable_hit(hit, n, num_computed_tokens)
        if ext > 0 and self.cfg.plan_loads and not self.costs.worth_loading(ext):
            self.stats.add("declined_hits")  # recomputing is estimated cheaper than loading
            self.stats.add("declined_tokens", ext)
            ext = 0
        if ext > 0 and self._wait_for_local_load(st, num_computed_tokens, n):
            self._release(st)
            return None, False
        if ext == 0:
            self._release(st)
        elif not st.stream and self.cfg.lookup_hit_reuse_s > 0:
            st.hit_answer = (n, num_computed_tokens, ext, time.monotonic() + self.cfg.lookup_hit_reuse_s)
        st.background = ext > 0 and self._in_background(st, ext)
        return ext, st.background

    def _may_ask(self, st: ReqState) -> bool:
        """After an `inflight` answer, the next lookup waits INFLIGHT_POLL_S: an engine with nothing
        else to run would otherwise step empty and ask the server in a tight loop, on the cores the
        engine computing the prefix needs. Idle, the scheduler sleeps out the rest (it halts nobody);
        busy, the request waits for a later step."""
        rest = st.ask_after - time.monotonic()
        if rest <= 0:
            return True
        if self.running or self.parked:
            return False
        time.sleep(rest)
        return True

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

    def _in_background(self, st: ReqState, ext: int) -> bool:
        """Load this hit in the background (vLLM parks the request until the load ends) rather than
        inside the step? A parked request holds its blocks for at least a step while computing
        nothing, and its first token is a step later: a load estimated at most in_step_load_share of
        the engine's recent step is cheaper inside it. Unknown estimates keep the background."""
        if not self.async_loads:
            return False
        if st.stream or self.multi_group:  # a streamed L2 hit, failures vLLM takes per request only
            return True
        return not self.costs.fits_in_step(ext, self.wait.period_s, self.cfg.in_step_load_share)

    def _reused_hit(self, st: ReqState, request: Request, num_computed_tokens: int) -> tuple[int | None, bool] | None:
        """vLLM could not schedule the request after a lookup that hit: a call within
        lookup_hit_reuse_s that asks the same (same length, same local prefix) gets the same answer,
        under the leases that lookup took (a new lookup would cost a round trip the scheduler waits
        for, on every step the request waits for blocks)."""
        answer = st.hit_answer
        if answer is None or not st.leased or st.load_failed:
            return None
        n, computed, ext, until = answer
        if n != int(request.num_tokens) or computed != num_computed_tokens or time.monotonic() >= until:
            return None
        self.stats.add("lookups_reused")
        if self._wait_for_local_load(st, num_computed_tokens, n):  # another request now brings it
            self._release(st)
            return None, False
        return ext, st.background

    def _wait_for_local_load(self, st: ReqState, num_computed_tokens: int, n: int) -> bool:
        """Another request of this engine is loading the chunk this one would load first: wait for
        it (vLLM caches those blocks when it ends), within timeout_s (local_loads.py)."""
        if not self.local_loads or st.request is None:
            return False
        c = num_computed_tokens // self.chunk
        if (c + 1) * self.chunk > n:
            return False
        digest = prefix_digests(
            st.request.all_token_ids, st.salt, self._extra(st, (c + 1) * self.chunk), self.chunk, c, c + 1
        )[0]
        owner = self.local_loads.owner(digest)
        if owner is None or owner == st.req_id or not self._may_wait(st):
            return False
        self.stats.add("lookups_wait_local_load")
        return True

    def _lookup(self, st: ReqState, request: Request, n: int) -> LookupResult | None:
        """The server's answer to this request's lookup (a LookupResult), or None while it is on its way.

        Sent once; each call waits at most lookup_wait_s for it, so the scheduler (and with it every
        running request of the engine) never stands still for a slow round trip. An answer that does
        not come within timeout_s is an error: the request is recomputed."""
        now = time.monotonic()
        client = self.client
        if client is None:  # a disabled connector never looks up: nothing is cached for it
            return LookupResult(0, None)
        if st.lookup_rid is None:
            self.stats.add("lookups")
            extra = self._extra(st, n)
            tails = self.tails and not extra
            sent = client.lookup_submit(
                list(request.all_token_ids[:n]),
                salt=st.salt,
                session=st.session,
                extra=extra,
                wait=self.cfg.wait_for_l2,
                expect=self.stream_l2,
                tails=tails,
            )
            if isinstance(sent, LookupResult):
                return sent  # it could not even be sent: the error
            st.lookup_rid, st.lookup_sent, st.lookup_tails = sent, now, tails
        t0 = time.perf_counter()
        # idle: nothing scheduled last step is still running, and no load vLLM waits for would be held up
        res = client.lookup_result(st.lookup_rid, self.wait.seconds(idle=not self.running and not self.parked))
        self.stats.add("scheduler_wait_s", time.perf_counter() - t0)
        if res is None and now - st.lookup_sent < self.cfg.timeout_s:
            return None
        if res is None:
            res = client.lookup_abandon(st.lookup_rid)
        st.lookup_rid = None
        return res

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[str, int]:
        """Split the external tokens by tier: "l1" (in the server's memory when first asked) and
        "l2" (brought into L1 by the prefetch the lookup started)."""
        st = self.reqs.get(request.request_id)
        if st is None or num_external_tokens <= 0:
            return {}
        l1_end = st.hit_tokens if st.l1_hit is None else min(st.l1_hit, st.hit_tokens)
        l1 = max(0, min(num_external_tokens, l1_end - st.local_computed))
        return {k: v for k, v in (("l1", l1), ("l2", num_external_tokens - l1)) if v}

    def _may_wait(self, st: ReqState, limit: float | None = None) -> bool:
        """Ask again later, for at most timeout_s per request (a server that keeps prefetching, e.g.
        restarted meanwhile, must not hold a request back for good; a producer that died, too)."""
        now = time.monotonic()
        if st.pending_since is None:
            st.pending_since = now
        return now - st.pending_since < (self.cfg.timeout_s if limit is None else limit)

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
    @property
    def tails(self) -> bool:
        """Look up and save tails: configured, taken by the workers' server, every group plain."""
        return self.cfg.tails and self.server_tails and not self.multi_group and not self.steps.exact

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
