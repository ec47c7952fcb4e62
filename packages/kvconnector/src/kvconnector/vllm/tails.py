"""A finished request's tail: the tokens past its last full chunk, saved as one more object.

Why: a conversation's next prompt is the previous one, its answer and a new message. That history
rarely ends on a chunk boundary, so whole chunks alone leave up to a chunk of already computed
tokens to recompute on every turn. The server stores such a tail under its own hash and finds it
where a later lookup's full chunks stop (docs/protocol.md, "Tails").

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


def tail_save(
    st: ReqState, request: Request, save_policy: str, chunk: int, block_size: int, extra_of: ExtraOf
) -> SaveJob | None:
    """The save of `request`'s tail, or None where it has none to save: what the policy stores
    ("all": every token whose KV a step computed, all but the last sampled one; "prompt": the
    prompt's) ends on a chunk boundary or within the first chunk, a chunk before it was left unsaved,
    the request has extra keys (adapters, images: tails take none), or its blocks are not all known.

    Why not within the first chunk: a tail takes a whole object's room, and a request shorter than a
    chunk (a short single-turn prompt, the commonest kind) would then cost up to a chunk's memory for
    a few tokens; with at least one full chunk before it, a tail at most doubles its request's objects."""
    if save_policy not in ("all", "prompt") or not st.cacheable or not st.block_ids or st.request is None:
        return None
    computed = min(int(request.num_computed_tokens), len(request.all_token_ids))
    if save_policy == "prompt":
        computed = min(computed, int(request.num_prompt_tokens))
    full = plan.floor_to(computed, chunk)
    if computed == full or full == 0 or st.saved_upto < full or extra_of(st, computed):
        return None
    nblocks = -(-computed // block_size)
    if not all(len(b) >= nblocks for b in st.block_ids):
        return None
    return SaveJob(
        st.req_id,
        list(request.all_token_ids[:computed]),
        [b[:nblocks] for b in st.block_ids],
        full,
        st.salt,
        (),
        st.epoch,
        tail=True,
    )


__all__ = ["tail_save"]
