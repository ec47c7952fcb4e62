"""What the scheduler-side connector tells the worker side for one engine step.

Plain dataclasses of ints, strings and int lists: vLLM may ship them to worker processes, and they
must stay cheap and safe to serialize (no tensors, no pickle-only objects).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


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
    """Store the full chunks of tokens [skip_tokens, len(tokens)) after this step's forward."""

    req_id: str
    tokens: list[int]  # chunk-aligned prefix of the request
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


@dataclass
class KVServerConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # request ids the workers may forget
    scheduled_tokens: int = 0  # tokens this step computes (0: a step without forward work)
    preempted: bool = False  # some request was preempted: its blocks may be reused in this step


@dataclass
class KVServerWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, per step: what was really stored, and what failed.

    req_id -> token position: `saved` the end of the request's stored prefix after a successful save;
    `save_failed` the skip_tokens of a save that failed (or was skipped, server down); `load_failed`
    the first token whose load failed (the server's copy of it is in doubt). With several workers a
    save counts only if no worker failed it.
    """

    saved: dict[str, int] = field(default_factory=dict)
    save_failed: dict[str, int] = field(default_factory=dict)
    load_failed: dict[str, int] = field(default_factory=dict)
    # cost samples for the load planner (costs.py): tokens loaded and the seconds that took; tokens the
    # step computed and the seconds its forward took. Ranks work in parallel: aggregate keeps the max.
    load_tokens: int = 0
    load_s: float = 0.0
    step_tokens: int = 0
    step_s: float = 0.0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVServerWorkerMetadata:
        if isinstance(other, KVServerWorkerMetadata):
            self.load_tokens, self.load_s = max(self.load_tokens, other.load_tokens), max(self.load_s, other.load_s)
            self.step_tokens, self.step_s = max(self.step_tokens, other.step_tokens), max(self.step_s, other.step_s)
            for mine, theirs in (
                (self.saved, other.saved),
                (self.save_failed, other.save_failed),
                (self.load_failed, other.load_failed),
            ):
                for req_id, pos in theirs.items():
                    mine[req_id] = min(pos, mine.get(req_id, pos))
        return self

    def is_empty(self) -> bool:
        return not (self.saved or self.save_failed or self.load_failed or self.load_tokens or self.step_tokens)
