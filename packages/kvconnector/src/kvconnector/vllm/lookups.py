"""The scheduler's lookup path: vLLM's get_num_new_matched_tokens, answered from the server's lookup.

What it decides per request: whether to ask at all (a miss or a hit answered moments ago stands, a
load of the same prefix by another request of this engine is waited for, a prefix another engine
announced is asked for again shortly), how long to wait for the answer without halting the
scheduler, what of the hit to report (whole chunks, or up to a stored tail; a prefix still being
written or prefetched from L2 is asked for again), and whether its load goes in the step or in the
background. SchedulerSide (scheduler.py) holds the state and the rest of the request's life.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from . import plan
from .._results import LookupResult
from .breaker import Breaker
from .config import ConnectorConfig
from .costs import CostModel
from .local_loads import LocalLoads, prefix_digests
from .lookup_wait import LookupWait
from .request_state import ReqState
from .stats import KVServerConnectorStats
from .step_plan import StepPlanner

INFLIGHT_POLL_S = 0.01  # after an `inflight` answer, ask the server again no sooner than this

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from ..engine_client import EngineClient


class LookupSide:
    """The lookup half of SchedulerSide, which sets these attributes and the helpers below."""

    cfg: ConnectorConfig
    client: EngineClient | None
    block_size: int
    chunk: int
    async_loads: bool
    multi_group: bool
    stream_l2: bool
    align_tails: bool
    server_tails: bool
    reqs: dict[str, ReqState]
    stats: KVServerConnectorStats
    breaker: Breaker
    costs: CostModel
    local_loads: LocalLoads
    steps: StepPlanner
    wait: LookupWait
    running: set[str]
    parked: set[str]

    def _state(self, request: Request) -> ReqState:
        raise NotImplementedError

    def _extra(self, st: ReqState, num_tokens: int) -> tuple[tuple[int, bytes], ...]:
        raise NotImplementedError

    def _release(self, st: ReqState) -> None:
        raise NotImplementedError

    def _failed(self, op: str, err: str) -> None:
        raise NotImplementedError

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

    @property
    def tails(self) -> bool:
        """Look up and save tails: configured, taken by the workers' server, every group plain."""
        return self.cfg.tails and self.server_tails and not self.multi_group and not self.steps.exact


__all__ = ["INFLIGHT_POLL_S", "LookupSide"]
