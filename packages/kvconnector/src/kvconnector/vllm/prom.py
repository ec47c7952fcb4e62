"""The connector's counters in vLLM's own /metrics, so vLLM dashboards show cache use.

vLLM's PrometheusStatLogger calls `observe` with each step's aggregated KVServerConnectorStats
payload (scheduler and workers summed); every counter of stats.COUNTERS becomes one Prometheus
counter named `vllm:kvserver_<name>` with vLLM's per-engine labels (model name, engine index).
Labels stay vLLM's: never request ids or salts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, PromMetric, PromMetricT


from .stats import COUNTERS

PREFIX = "vllm:kvserver_"
_HELP = {
    "lookups": "Lookups the connector sent to kvserver.",
    "lookup_errors": "Lookups that failed (the request recomputed).",
    "lookup_tokens": "Prompt tokens the connector asked kvserver about.",
    "hit_tokens": "Prompt tokens kvserver held (the reusable prefix).",
    "external_tokens": "Tokens vLLM chose to load from kvserver.",
    "loads": "Load jobs run by workers.",
    "load_errors": "Load jobs that failed (their blocks were recomputed).",
    "loaded_tokens": "Tokens loaded from kvserver into vLLM's KV cache.",
    "failed_blocks": "Blocks reported failed to vLLM (recomputed).",
    "load_s": "Seconds workers spent loading.",
    "saves": "Save jobs run by workers.",
    "save_errors": "Save jobs that failed.",
    "saved_chunks": "Chunks written to kvserver.",
    "save_s": "Seconds workers spent saving.",
    "skipped_server_down": "Lookups skipped while the server was marked down.",
    "lookups_pending": "Lookups answered 'ask again later' while kvserver prefetched from L2.",
    "lookups_streamed": "L2 hits reported while kvserver's prefetch still brought them into L1 (streamed loads).",
    "lookups_inflight": "Lookups answered 'ask again later': a producer wrote, or another engine computed, the prefix.",
    "announced_chunks": "Chunks announced to the server before the forward that computes them.",
    "lookups_wait_local_load": "Lookups answered 'ask again later': another request of the engine loaded that prefix.",
    "partial_saves": "Saves kvserver stored only in part (no room for the rest).",
    "no_space_saves": "Saves of which nothing fitted in kvserver's full cache.",
    "declined_hits": "Hits not loaded because recomputing was estimated cheaper.",
    "declined_tokens": "Tokens of declined hits (recomputed).",
    "loads_past_saves": "Background loads that ended while a save submitted before them still ran.",
    "steps_during_loads": "Forward steps that ran while a background load was in flight.",
    "idle_waits": "Steps with nothing to compute that waited for a background load or save instead of spinning.",
    "scheduler_wait_s": "Seconds vLLM's scheduler waited for kvserver's lookup answers (its step loop halted).",
    "lookups_deferred": "Scheduler calls answered 'ask again later': the lookup's answer was still on its way.",
    "loads_in_step": "Hits loaded inside the engine step (a short copy) rather than in the background.",
    "parked_steps": "Steps times requests vLLM kept parked while their background load ran.",
    "lookups_reused": "Scheduler calls answered from the request's recent miss or hit, without a new lookup.",
    "loads_streamed_apart": "Streamed L2 loads run on their own thread, so L1 loads never wait behind them.",
    "empty_steps": "Scheduler steps that scheduled no token (every waiting request deferred, or nothing to do).",
    "tail_hits": "Lookups whose hit ended in a stored tail: the KV past a finished request's last full chunk.",
    "tail_saves": "Tails saved: tokens of a finished request past its last full chunk, its prompt's and its answer's.",
    "tails_before_forward": "Tail saves started before the forward of their step.",
    "finished_held_steps": "Steps times finished requests whose blocks vLLM kept past a step, waiting for their saves.",
}


def metric_name(counter: str) -> str:
    """`load_s` -> `vllm:kvserver_load_seconds`; the client library adds `_total`."""
    return PREFIX + (counter[:-2] + "_seconds" if counter.endswith("_s") else counter)


class KVServerPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._bound: dict[tuple[int, str], Any] = {}
        for name in COUNTERS:
            counter = self._counter_cls(
                name=metric_name(name), documentation=_HELP.get(name, name), labelnames=labelnames
            )
            for engine_idx, values in per_engine_labelvalues.items():
                self._bound[(engine_idx, name)] = counter.labels(*values)

    def observe(self, transfer_stats_data: Mapping[str, object], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            bound = self._bound.get((engine_idx, name))
            if bound is not None and isinstance(value, int | float) and value > 0:
                bound.inc(value)
