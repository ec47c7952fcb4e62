"""Each step's load and save jobs for one request: what its metadata tells the workers to copy.

Loads run before the forward (or in the background while vLLM parks the request), saves after it:
a save names the chunks this step completes, from the blocks vLLM gave the request in every KV cache
group. A load vLLM was promised but whose blocks cannot be named fails safe (reported failed, so vLLM
recomputes them) rather than computing over uninitialised blocks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Protocol

from . import plan
from ..engine_kv import token_blocks
from .config import ConnectorConfig
from .log import log
from .jobs import LoadJob, SaveJob
from .request_state import ReqState, prompt_len, tokens_of

ExtraOf = Callable[[ReqState, int], tuple[tuple[int, bytes], ...]]  # a request's extra keys up to a token


class StepJobs(Protocol):
    """Where a step's jobs go (the step's KVServerConnectorMetadata)."""

    loads: list[LoadJob]
    saves: list[SaveJob]


class StepPlanner:
    def __init__(
        self, cfg: ConnectorConfig, connected: bool, block_size: int, extra: ExtraOf, exact: bool = False
    ) -> None:
        self.cfg = cfg
        self.connected = connected  # False: no client (a disabled connector saves nothing)
        self.block_size = block_size
        self.chunk = cfg.chunk_size
        self.extra = extra
        # sliding-window or recurrent-state groups: their blocks at a boundary are valid only while
        # vLLM keeps them (a window's, a state's two steps), so only a boundary this step starts at or
        # computes is saved; one left behind earlier is given up, never read from a reused block
        self.exact = exact

    def plan(
        self,
        meta: StepJobs,
        st: ReqState,
        num_computed: int,
        num_scheduled: int,
        prompt_tokens: list[int] | None,
    ) -> None:
        """The request's pending load, and a save of the chunks this step completes."""
        if st.load_pending:
            self.plan_load(meta, st, prompt_tokens)
        if self.cfg.save_policy == "none" or not self.connected or not st.cacheable:
            return
        limit = prompt_len(st, prompt_tokens) if self.cfg.save_policy == "prompt" else 1 << 62
        save_to = plan.save_end(st.saved_upto, num_computed + num_scheduled, limit, self.chunk)
        if save_to is None:
            return
        end = save_to
        if self.exact and end < num_computed:
            log.debug("KVServerConnector: request %s: boundary %d is behind the step, not saved", st.req_id, end)
            st.saved_upto = end
            return
        toks = tokens_of(st, end, prompt_tokens)
        nblocks = end // self.block_size
        if len(toks) < end or not covers(st.block_ids, nblocks):
            return
        st.had_saves = True
        reservation, total = None, 0
        if self.cfg.reserve and self.cfg.save_policy == "prompt":  # the total is known: the prompt's full chunks
            reservation, total = hashlib.sha256(st.session.encode()).hexdigest()[:32], limit // self.chunk
        meta.saves.append(
            SaveJob(
                st.req_id,
                toks,
                [b[:nblocks] for b in st.block_ids],
                st.saved_upto,
                st.salt,
                self.extra(st, end),
                st.epoch,
                reservation,
                total,
            )
        )
        st.saved_upto = end

    def plan_load(
        self, meta: StepJobs, st: ReqState, prompt_tokens: list[int] | None, background: bool = False
    ) -> None:
        st.load_pending = False
        end = plan.load_end(st.local_computed, st.external_tokens, self.chunk, st.hit_tokens, self.block_size)
        toks = tokens_of(st, end, prompt_tokens)
        nblocks = token_blocks(0, end, self.block_size)[1]  # the blocks the load's range lies in
        # the tokens naming the load's objects: up to `end`, or where a tail's block runs past the
        # prompt (the whole prompt a tail reached), up to the hit's end
        named = len(toks) == end or (st.hit_tokens % self.chunk != 0 and len(toks) >= st.hit_tokens)
        if named and covers(st.block_ids, nblocks) and not self.cfg.debug_fail_plan_loads:
            meta.loads.append(
                LoadJob(
                    st.req_id,
                    st.session,
                    toks,
                    [b[:nblocks] for b in st.block_ids],
                    st.local_computed,
                    end,
                    st.salt,
                    self.extra(st, end),
                    st.epoch,
                    background=background,
                    compute_from=st.local_computed + st.external_tokens,
                    stream=st.stream,
                )
            )
            st.loaded_tokens = st.external_tokens
            st.leased = False  # the worker releases the session once the load is done
        else:
            self._fail_load(meta, st, end, nblocks, background)

    def _fail_load(self, meta: StepJobs, st: ReqState, end: int, nblocks: int, background: bool = False) -> None:
        """vLLM was promised external tokens that we cannot load (cannot happen with vLLM 0.32's
        allocation). Fail safe: the worker reports the blocks of the promised range as failed, so
        vLLM recomputes them instead of computing over uninitialised blocks, and nothing of the
        request from there on is saved before the scheduler hears of the failure."""
        log.error(
            "KVServerConnector: request %s has %d blocks for a %d-token load; reporting them failed",
            st.req_id,
            min((len(b) for b in st.block_ids), default=0),
            end,
        )
        meta.loads.append(
            LoadJob(
                st.req_id,
                st.session,
                [],
                [b[:nblocks] for b in st.block_ids],
                st.local_computed,
                end,
                st.salt,
                (),
                st.epoch,
                fail="blocks missing for the promised load",
                background=background,
            )
        )
        st.loaded_tokens = 0


def covers(block_ids: list[list[int]], nblocks: int) -> bool:
    """Every KV cache group's table reaches block nblocks (a sliding group's out-of-window entries
    are vLLM's null block: they count, and are never read or written)."""
    return bool(block_ids) and all(len(b) >= nblocks for b in block_ids)
