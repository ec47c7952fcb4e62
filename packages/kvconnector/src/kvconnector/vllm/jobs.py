"""The jobs one step's metadata carries to the workers: loads before the forward, saves after it.

Plain frozen dataclasses of ints, strings and int lists (vLLM may ship them to worker processes), and
free of vLLM imports, so the planning that builds them is testable without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoadJob:
    """Write blocks for tokens [skip_tokens, num_tokens) of a request from the cache, before the forward."""

    req_id: str
    session: str
    tokens: list[int]  # the first num_tokens tokens of the request
    block_ids: list[list[int]]  # per KV cache group, the request's blocks covering [0, num_tokens)
    skip_tokens: int  # tokens vLLM already holds (its own prefix cache); never overwritten
    num_tokens: int  # chunk-aligned end of the load
    salt: str
    extra: tuple[tuple[int, bytes], ...] = ()  # per-chunk extra keys (extra_keys.py)
    epoch: int = 0  # the request's load-failure epoch when planned (see SaveJob.epoch)
    fail: str = ""  # non-empty: do not load, report these blocks as failed (the scheduler cannot name them)
    background: bool = False  # an asynchronous load: copy on the worker's loader thread, report in get_finished
    # the first token vLLM computes after the load (local + external tokens); a sliding window needs
    # exactly the blocks that token attends to, which vLLM allocated (the others are its null block)
    compute_from: int = -1
    # the range is still landing in the server's L1 (a streamed L2 hit): load chunks as they land, and
    # report those that never do as failed (EngineClient.load_streamed)
    stream: bool = False


@dataclass(frozen=True, slots=True)
class SaveJob:
    """Store the full chunks of tokens [skip_tokens, len(tokens)) after this step's forward (with
    `tail`, the partial last chunk too)."""

    req_id: str
    tokens: list[int]  # chunk-aligned prefix of the request (with tail: the request's computed tokens)
    block_ids: list[list[int]]  # per KV cache group
    skip_tokens: int  # chunk-aligned; chunks below are known to be stored already
    salt: str
    extra: tuple[tuple[int, bytes], ...] = ()
    # How many failed loads of this request the scheduler knew of when it planned the save. A worker
    # that saw a load of this request fail at an epoch >= this one drops the save: the step that
    # computed these chunks was planned before the failure was known (async scheduling plans step
    # N+1 before step N's results arrive), so it may have attended to garbage blocks.
    epoch: int = 0
    # A producer's whole-request reservation (docs/pd.md): its id and the request's total chunks
    reservation: str | None = None
    total_chunks: int = 0
    # the tokens end inside a chunk: store that partial last chunk too, as a tail (a finished request's)
    tail: bool = False
