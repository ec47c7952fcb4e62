"""What the scheduler side remembers of one request between vLLM's calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass
class ReqState:
    req_id: str
    request: Request | None  # its all_token_ids grow as tokens are generated; None: never looked up
    salt: str
    session: str
    hit_tokens: int = 0
    local_computed: int = 0
    external_tokens: int = 0
    load_pending: bool = False
    leased: bool = False
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    saved_upto: int = 0  # chunk-aligned: tokens [0, saved_upto) are stored or being stored
    stored: int = 0  # tokens [0, stored) confirmed stored by the workers (or found on the server)
    loaded_tokens: int = 0
    had_saves: bool = False  # a SaveJob was planned (async_saves: vLLM must keep the blocks until "sent")
    l2_tokens: int = 0  # of loaded_tokens, those the server's L2 prefetch brought into L1
    load_failed: bool = False
    cacheable: bool = True  # False: never looked up nor saved (prompt embeddings, unknown adapter, ...)
    epoch: int = 0  # failed loads the scheduler has heard of (SaveJob.epoch)
    pending_since: float | None = None  # monotonic time of the first "L2 prefetch pending" answer
    lookup_rid: int | None = None  # a lookup sent whose answer has not been taken yet
    lookup_tails: bool = False  # that lookup asked for tails: its hit may end inside a chunk
    ask_after: float = 0.0  # monotonic: after an `inflight` answer, the next lookup is not sent before
    lookup_sent: float = 0.0  # monotonic time it was sent
    miss_n: int = -1  # the request's length when a lookup last found nothing for it
    miss_until: float = 0.0  # monotonic time until which that miss answers a repeated call
    # a hit's answer (length, local prefix, external tokens, valid until): a repeated call asking the
    # same gets it under the leases its lookup took
    hit_answer: tuple[int, int, int, float] | None = None
    l1_hit: int | None = None  # the L1 hit before the server's L2 prefetch (tokens); None: no prefetch
    background: bool = False  # its hit loads in the background (vLLM parks it); False: inside the step
    stream: bool = False  # the hit reported is still landing in L1 (the server's L2 prefetch): a streamed load


def tokens_of(st: ReqState, end: int, prompt_tokens: list[int] | None) -> list[int]:
    """The request's first `end` tokens (from vLLM's Request, else the prompt the step names)."""
    if st.request is not None:
        return list(st.request.all_token_ids[:end])
    return list((prompt_tokens or [])[:end])


def prompt_len(st: ReqState, prompt_tokens: list[int] | None) -> int:
    if st.request is not None:
        return int(st.request.num_prompt_tokens)
    return len(prompt_tokens or [])
