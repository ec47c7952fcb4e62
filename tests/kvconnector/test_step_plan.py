"""The per-step save plan (vllm/step_plan.py) without vLLM: which chunks a step's jobs save."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvconnector.vllm.config import parse_config
from kvconnector.vllm.jobs import LoadJob, SaveJob
from kvconnector.vllm.request_state import ReqState
from kvconnector.vllm.step_plan import StepPlanner


@dataclass
class Jobs:  # what KVServerConnectorMetadata holds of a step's jobs (that class needs vLLM)
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)


CHUNK, BS = 256, 32
PROMPT = list(range(1000, 1700))  # 700 tokens: two full chunks


def _planner(exact: bool) -> StepPlanner:
    cfg = parse_config({"chunk_size": CHUNK})
    return StepPlanner(cfg, True, BS, lambda st, n: (), exact)


def _state() -> ReqState:
    st = ReqState(req_id="r", request=None, salt="", session="s" * 32)
    st.block_ids = [list(range(1, 23)), list(range(100, 122))]  # two KV cache groups, 22 blocks each
    return st


def test_a_step_saves_the_chunks_it_completes() -> None:
    meta, st = Jobs(), _state()
    _planner(exact=True).plan(meta, st, 0, 600, PROMPT)
    assert [(job.skip_tokens, len(job.tokens)) for job in meta.saves] == [(0, 512)]
    assert [len(b) for b in meta.saves[0].block_ids] == [16, 16]
    assert st.saved_upto == 512


def test_an_exact_groups_boundary_left_behind_is_given_up_not_saved() -> None:
    """A sliding window or a recurrent state at 512 lives in blocks vLLM frees soon after: a step
    that starts at 640 must not read them (they may hold another request's KV by now). Without such
    groups the same chunks are saved (full attention keeps every block while the request runs)."""
    meta, st = Jobs(), _state()
    _planner(exact=True).plan(meta, st, 640, 10, PROMPT)
    assert meta.saves == [] and st.saved_upto == 512
    meta, st = Jobs(), _state()
    _planner(exact=False).plan(meta, st, 640, 10, PROMPT)
    assert [len(job.tokens) for job in meta.saves] == [512]


def test_an_exact_groups_boundary_at_the_steps_start_is_saved() -> None:
    """The state or window at the very token a step starts from is what that step reads: still held."""
    meta, st = Jobs(), _state()
    _planner(exact=True).plan(meta, st, 512, 100, PROMPT)
    assert [len(job.tokens) for job in meta.saves] == [512]
