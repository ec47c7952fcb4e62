"""What the scheduler-side connector tells the worker side for one engine step.

Plain dataclasses of ints, strings and int lists: vLLM may ship them to worker processes, and they
must stay cheap and safe to serialize (no tensors, no pickle-only objects).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from .jobs import LoadJob, SaveJob

__all__ = ["KVServerConnectorMetadata", "KVServerWorkerMetadata", "LoadJob", "SaveJob"]


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
    loads: int = 0
    load_tokens: int = 0
    load_s: float = 0.0
    # of those, the loads copied inside the step, and the calibration: a copy's own cost (a background
    # copy's time also counts its waits for the CPU and GIL it shares with the forward)
    in_step_loads: int = 0
    in_step_tokens: int = 0
    in_step_s: float = 0.0
    load_fixed_s: float = 0.0  # the calibration's fixed part of one load (its round trips), sent once
    step_tokens: int = 0
    step_s: float = 0.0
    # whether the server the workers registered with takes tails (partial last chunks): sent when it
    # changes (a registration, a server restarted into another version); None: no news
    tails: bool | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVServerWorkerMetadata:
        if isinstance(other, KVServerWorkerMetadata):
            self.loads, self.in_step_loads = max(self.loads, other.loads), max(self.in_step_loads, other.in_step_loads)
            self.load_tokens, self.load_s = max(self.load_tokens, other.load_tokens), max(self.load_s, other.load_s)
            self.in_step_tokens = max(self.in_step_tokens, other.in_step_tokens)
            self.in_step_s = max(self.in_step_s, other.in_step_s)
            self.load_fixed_s = max(self.load_fixed_s, other.load_fixed_s)
            self.step_tokens, self.step_s = max(self.step_tokens, other.step_tokens), max(self.step_s, other.step_s)
            if other.tails is not None:  # every rank's server must take them
                self.tails = other.tails if self.tails is None else self.tails and other.tails
            for mine, theirs in (
                (self.saved, other.saved),
                (self.save_failed, other.save_failed),
                (self.load_failed, other.load_failed),
            ):
                for req_id, pos in theirs.items():
                    mine[req_id] = min(pos, mine.get(req_id, pos))
        return self

    def is_empty(self) -> bool:
        return not (
            self.saved
            or self.save_failed
            or self.load_failed
            or self.load_tokens
            or self.step_tokens
            or self.tails is not None
        )
