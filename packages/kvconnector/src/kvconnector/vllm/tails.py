"""A finished request's tail: the tokens past its last full chunk, saved as one more object.

Why: a conversation's next prompt is the previous one, its answer and a new message. That history
rarely ends on a chunk boundary, so whole chunks alone leave up to a chunk of already computed
tokens to recompute on every turn. The server stores such a tail under its own hash and finds it
where a later lookup's full chunks stop (docs/protocol.md, "Tails").

With save_policy "all" a request has up to two tails: its prompt's and its answer's (tail_saves).
Planned when vLLM reports the request finished (its blocks are kept until the save has read them,
as for every background save), carried by the next step's metadata to the workers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from . import plan
from .jobs import SaveJob
from .request_state import ReqState

if TYPE_CHECKING:
    from vllm.v1.request import Request

ExtraOf = Callable[[ReqState, int], tuple[tuple[int, bytes], ...]]


def tail_saves(
    st: ReqState, request: Request, save_policy: str, chunk: int, block_size: int, extra_of: ExtraOf
) -> list[SaveJob]:
    """The saves of `request`'s tails: the tail of what the policy stores ("all": every token whose KV
    a step computed, all but the last sampled one; "prompt": the prompt's), and with "all" also the
    prompt's own tail where the answer went past it.

    Why both with "all": the next turn of a chat holds the answer, so it continues the longer tail;
    the same prompt sent again (a retry, another sample, a prompt extended without its answer) ends
    inside the answer's tail and finds only the prompt's. The server keeps several tail lengths per
    chunk and a lookup takes the longest that matches."""
    if save_policy not in ("all", "prompt") or not st.cacheable or not st.block_ids or st.request is None:
        return []
    computed = min(int(request.num_computed_tokens), len(request.all_token_ids))
    prompt = min(computed, int(request.num_prompt_tokens))
    ends = [prompt] if save_policy == "prompt" else sorted({prompt, computed})
    jobs = (_tail_job(st, request, end, chunk, block_size, extra_of) for end in ends)
    return [job for job in jobs if job is not None]


def _tail_job(
    st: ReqState, request: Request, end: int, chunk: int, block_size: int, extra_of: ExtraOf
) -> SaveJob | None:
    """The save of the tokens between `end`'s last full chunk and `end`, or None where there is none
    to save: `end` is on a chunk boundary or within the first chunk, a chunk before it was left
    unsaved, the request has extra keys (adapters, images: tails take none), or its blocks are not
    all known.

    Why not within the first chunk: a tail takes a whole object's room, and a request shorter than a
    chunk (a short single-turn prompt, the commonest kind) would then cost up to a chunk's memory for
    a few tokens; with at least one full chunk before it, a request's tails at most double its
    objects."""
    full = plan.floor_to(end, chunk)
    if end == full or full == 0 or st.saved_upto < full or extra_of(st, end):
        return None
    nblocks = -(-end // block_size)
    if not all(len(b) >= nblocks for b in st.block_ids):
        return None
    return SaveJob(
        st.req_id,
        list(request.all_token_ids[:end]),
        [b[:nblocks] for b in st.block_ids],
        full,
        st.salt,
        (),
        st.epoch,
        tail=True,
    )


__all__ = ["tail_saves"]
