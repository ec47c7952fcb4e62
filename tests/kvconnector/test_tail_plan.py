"""The tail save of a finished request (vllm/tails.py) and the load end of a tail hit (plan.py),
without vLLM."""

from __future__ import annotations

from dataclasses import dataclass

from kvconnector.vllm import plan
from kvconnector.vllm.jobs import SaveJob
from kvconnector.vllm.request_state import ReqState
from kvconnector.vllm.tails import tail_saves

CHUNK, BS = 256, 16


@dataclass
class FinishedRequest:  # what tail_saves reads of vLLM's Request
    all_token_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int


def _state(request: FinishedRequest, blocks: int = 40) -> ReqState:
    st = ReqState(req_id="r", request=request, salt="", session="s" * 32)  # type: ignore[arg-type]
    st.block_ids = [list(range(100, 100 + blocks))]
    st.saved_upto = 512
    return st


def _none(st: ReqState, n: int) -> tuple[tuple[int, bytes], ...]:
    return ()


def _one(st: ReqState, req: FinishedRequest, policy: str) -> SaveJob | None:
    """The request's only tail save, or None where it has none."""
    jobs = tail_saves(st, req, policy, CHUNK, BS, _none)  # type: ignore[arg-type]
    assert len(jobs) <= 1
    return jobs[0] if jobs else None


def test_all_saves_the_prompts_tail_and_the_answers_prompt_only_the_prompts() -> None:
    req = FinishedRequest(list(range(600 + 8)), num_computed_tokens=607, num_prompt_tokens=600)
    prompt_tail, answer_tail = tail_saves(_state(req), req, "all", CHUNK, BS, _none)  # type: ignore[arg-type]
    assert prompt_tail.tail and answer_tail.tail
    assert (len(prompt_tail.tokens), prompt_tail.skip_tokens, len(prompt_tail.block_ids[0])) == (600, 512, 38)
    assert (len(answer_tail.tokens), answer_tail.skip_tokens, len(answer_tail.block_ids[0])) == (607, 512, 38)
    job = _one(_state(req), req, "prompt")
    assert job is not None and (len(job.tokens), len(job.block_ids[0])) == (600, 38)
    assert _one(_state(req), req, "none") is None


def test_all_saves_one_tail_where_the_prompt_or_the_answer_has_none() -> None:
    # a prompt on a chunk boundary: the answer's tail only
    on_boundary = FinishedRequest(list(range(530)), num_computed_tokens=529, num_prompt_tokens=512)
    job = _one(_state(on_boundary), on_boundary, "all")
    assert job is not None and (len(job.tokens), job.skip_tokens) == (529, 512)
    # an answer that ends a chunk: the prompt's tail only (the chunk itself is a plain save)
    ends_chunk = FinishedRequest(list(range(769)), num_computed_tokens=768, num_prompt_tokens=700)
    st = _state(ends_chunk, blocks=48)
    st.saved_upto = 768
    job = _one(st, ends_chunk, "all")
    assert job is not None and (len(job.tokens), job.skip_tokens) == (700, 512)
    # a request vLLM stopped within its prompt (preempted, aborted): one tail, the prompt's part computed
    partial = FinishedRequest(list(range(600)), num_computed_tokens=580, num_prompt_tokens=600)
    job = _one(_state(partial), partial, "all")
    assert job is not None and len(job.tokens) == 580


def test_no_tail_on_a_boundary_in_chunk_0_after_an_unsaved_chunk_with_extra_keys_or_blocks_missing() -> None:
    on_boundary = FinishedRequest(list(range(520)), num_computed_tokens=512, num_prompt_tokens=512)
    assert _one(_state(on_boundary), on_boundary, "all") is None
    req = FinishedRequest(list(range(608)), num_computed_tokens=607, num_prompt_tokens=600)
    behind = _state(req)
    behind.saved_upto = 256  # chunk 1 not saved: its tail would hang off nothing
    assert tail_saves(behind, req, "all", CHUNK, BS, _none) == []  # type: ignore[arg-type]
    adapter = tail_saves(_state(req), req, "all", CHUNK, BS, lambda st, n: ((0, b"a" * 32),))  # type: ignore[arg-type]
    assert adapter == []
    assert tail_saves(_state(req, blocks=37), req, "all", CHUNK, BS, _none) == []  # type: ignore[arg-type]
    short = FinishedRequest(list(range(108)), num_computed_tokens=107, num_prompt_tokens=100)
    first = _state(short)
    first.saved_upto = 0
    assert tail_saves(first, short, "all", CHUNK, BS, _none) == []  # type: ignore[arg-type]  # within chunk 0


def test_a_tail_hit_loads_to_the_block_of_its_last_token_a_chunk_hit_to_its_chunk() -> None:
    # the hit ends 95 tokens into chunk 2: the load stops at the block holding token 606
    assert plan.load_end(0, 607, CHUNK, 607, BS) == 608
    assert plan.load_end(512, 95, CHUNK, 607, BS) == 608
    # a hit of whole chunks whose last token vLLM must compute: the whole chunk, as before
    assert plan.load_end(0, 511, CHUNK, 512, BS) == 512
    assert plan.load_end(0, 511, CHUNK) == 512
