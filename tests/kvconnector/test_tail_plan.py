"""The tail save of a finished request (vllm/tails.py) and the load end of a tail hit (plan.py),
without vLLM."""

from __future__ import annotations

from dataclasses import dataclass

from kvconnector.vllm import plan
from kvconnector.vllm.request_state import ReqState
from kvconnector.vllm.tails import tail_save

CHUNK, BS = 256, 16


@dataclass
class FinishedRequest:  # what tail_save reads of vLLM's Request
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


def test_all_saves_every_computed_token_past_the_last_chunk_and_prompt_only_the_prompts() -> None:
    req = FinishedRequest(list(range(600 + 8)), num_computed_tokens=607, num_prompt_tokens=600)
    job = tail_save(_state(req), req, "all", CHUNK, BS, _none)  # type: ignore[arg-type]
    assert job is not None and job.tail
    assert (len(job.tokens), job.skip_tokens, len(job.block_ids[0])) == (607, 512, 38)  # ceil(607 / 16)
    job = tail_save(_state(req), req, "prompt", CHUNK, BS, _none)  # type: ignore[arg-type]
    assert job is not None and (len(job.tokens), len(job.block_ids[0])) == (600, 38)
    assert tail_save(_state(req), req, "none", CHUNK, BS, _none) is None  # type: ignore[arg-type]


def test_no_tail_on_a_boundary_in_chunk_0_after_an_unsaved_chunk_with_extra_keys_or_blocks_missing() -> None:
    on_boundary = FinishedRequest(list(range(520)), num_computed_tokens=512, num_prompt_tokens=512)
    assert tail_save(_state(on_boundary), on_boundary, "all", CHUNK, BS, _none) is None  # type: ignore[arg-type]
    req = FinishedRequest(list(range(608)), num_computed_tokens=607, num_prompt_tokens=600)
    behind = _state(req)
    behind.saved_upto = 256  # chunk 1 not saved: its tail would hang off nothing
    assert tail_save(behind, req, "all", CHUNK, BS, _none) is None  # type: ignore[arg-type]
    adapter = tail_save(_state(req), req, "all", CHUNK, BS, lambda st, n: ((0, b"a" * 32),))  # type: ignore[arg-type]
    assert adapter is None
    assert tail_save(_state(req, blocks=37), req, "all", CHUNK, BS, _none) is None  # type: ignore[arg-type]
    short = FinishedRequest(list(range(108)), num_computed_tokens=107, num_prompt_tokens=100)
    first = _state(short)
    first.saved_upto = 0
    assert tail_save(first, short, "all", CHUNK, BS, _none) is None  # type: ignore[arg-type]  # within chunk 0


def test_a_tail_hit_loads_to_the_block_of_its_last_token_a_chunk_hit_to_its_chunk() -> None:
    # the hit ends 95 tokens into chunk 2: the load stops at the block holding token 606
    assert plan.load_end(0, 607, CHUNK, 607, BS) == 608
    assert plan.load_end(512, 95, CHUNK, 607, BS) == 608
    # a hit of whole chunks whose last token vLLM must compute: the whole chunk, as before
    assert plan.load_end(0, 511, CHUNK, 512, BS) == 512
    assert plan.load_end(0, 511, CHUNK) == 512
