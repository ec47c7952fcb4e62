"""Connector counters, reported through vLLM's KVConnectorStats hooks.

vLLM collects worker stats every step (`get_kv_connector_stats`), ships them to the scheduler,
aggregates them with the scheduler side's, and logs `reduce()` when stats logging is on. Counts only:
no request ids, no salts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

COUNTERS = (
    "lookups",
    "lookup_errors",
    "lookups_pending",
    "lookups_streamed",  # L2 hits reported while the server's prefetch still brought them into L1
    "lookups_inflight",  # "ask again later": a producer writes, or another engine announced, the prefix
    "announced_chunks",  # chunks announced to the server before the forward that computes them
    "lookups_wait_local_load",  # "ask again later": another request of this engine loads the same prefix
    "lookup_tokens",
    "hit_tokens",
    "external_tokens",
    "loads",
    "load_errors",
    "loaded_tokens",
    "failed_blocks",
    "load_s",
    "verify_failures",  # loads failed because cached bytes did not match their committed checksum
    "saves",
    "save_errors",
    "saved_chunks",
    "save_s",
    "skipped_server_down",
    "uncacheable_requests",
    "unsafe_saves_dropped",
    "partial_saves",  # saves the server stored only in part: the cache had no room for the rest (NO_SPACE)
    "no_space_saves",  # saves of which nothing fitted (NO_SPACE); neither counts as save_errors
    "declined_hits",
    "declined_tokens",  # hits plan_loads left to recompute (estimated cheaper)
    "save_drains",  # steps that waited for background saves (a preempted request's blocks get reused)
    "loads_past_saves",  # background loads that ended while a save submitted before them still ran
    "steps_during_loads",  # forward steps that ran while a background load (async_loads) was in flight
    "idle_waits",  # steps with nothing to compute that waited (up to 2 ms) for a background load or save
    "scheduler_wait_s",  # seconds vLLM's scheduler waited for lookup answers (its step loop stood still)
    "lookups_deferred",  # calls answered "ask again later" because the lookup's answer was still on its way
    "loads_in_step",  # hits loaded inside the step: estimated at most in_step_load_share of a step
    "parked_steps",  # steps x requests parked by vLLM while their background load ran (WAITING_FOR_REMOTE_KVS)
    "lookups_reused",  # calls answered from the request's recent miss or hit (vLLM could not schedule it then)
    "loads_streamed_apart",  # streamed L2 loads run on their own thread, beside the L1 loads (loader.py)
    "empty_steps",  # scheduler steps that scheduled no token (e.g. every waiting request deferred)
    "tail_hits",  # lookups whose hit ended in a stored tail (a partial last chunk)
    "tail_saves",  # tails saved: a finished request's tokens past its last full chunk (up to two: tails.py)
    "tails_before_forward",  # tail saves started at bind, before the step's forward (start_tails)
    "finished_held_steps",  # steps x finished requests whose blocks vLLM kept past a step for their saves
)


@dataclass
class KVServerConnectorStats(KVConnectorStats):
    data: dict[str, float] = field(default_factory=dict)  # counters by name

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def add(self, name: str, value: float = 1) -> None:
        self.data[name] = self.data.get(name, 0) + value

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVServerConnectorStats:
        for name, value in other.data.items():
            if isinstance(value, (int, float)):
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: v for k, v in self.data.items() if isinstance(v, (int, float))}
        asked = out.get("lookup_tokens", 0)
        out["hit_rate"] = round(out.get("hit_tokens", 0) / asked, 4) if asked else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in COUNTERS)

    def take(self) -> KVServerConnectorStats | None:
        """A copy of the counters since the last take (None when nothing happened), then reset."""
        if self.is_empty():
            return None
        snap = KVServerConnectorStats(data=dict(self.data))
        self.reset()
        return snap
