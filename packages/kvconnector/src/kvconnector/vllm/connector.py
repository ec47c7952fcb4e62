"""KVServerConnector: vLLM 0.32's KV connector (v1 API) backed by a kvserver.

    LLM(..., kv_transfer_config={
        "kv_connector": "KVServerConnector", "kv_connector_module_path": "kvconnector.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvserver_url": "tcp://127.0.0.1:5555"}})

vLLM creates one instance per role: the scheduler's (lookups, planning) and each worker's (copies).
This class only dispatches to `SchedulerSide` / `WorkerSide`; a broken cache never breaks the engine:
errors turn into misses and recomputation.

It implements `SupportsHMA`, so vLLM keeps its hybrid KV cache manager on: each KV cache group
(full attention, sliding window) is one object group with its own block table (docs/layouts.md).
A single-group model is unchanged: one object group, the same layout fingerprint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence


from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .config import ConnectorConfig, parse_config
from .log import log
from .metadata import KVServerConnectorMetadata
from .fingerprint import config_parts, model_fingerprint, model_key_with_fingerprint
from .scheduler import SchedulerSide
from .stats import KVServerConnectorStats
from .vllm_layout import KVBackend, UnsupportedLayout, engine_backend, scheduler_layouts, worker_layouts
from .worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from kvprotocol import LayoutDescriptor
    from ..engine_client import EngineClient
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KVServerConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.cfg: ConnectorConfig = parse_config(tc.kv_connector_extra_config).apply_role(
            tc.is_kv_producer, tc.is_kv_consumer
        )
        block_size = int(vllm_config.cache_config.block_size)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._backend: KVBackend | None = None
        layouts: list[LayoutDescriptor] | None = None
        try:
            self._backend = engine_backend(vllm_config, kv_cache_config)
            layouts = scheduler_layouts(kv_cache_config, self.cfg.chunk_size, self._backend)
        except UnsupportedLayout as exc:
            log.error("KVServerConnector disabled: %s", exc)
        if layouts is not None:  # a model the connector leaves alone starts whatever its block size
            self.cfg.check_block_size(block_size)
        exact = layouts is not None and any(lay.kind != "full" for lay in layouts)  # sliding or state groups
        if exact and layouts is not None and len(layouts) > 1 and self.cfg.async_saves:
            # vLLM's hybrid manager frees a sliding-window block as soon as it leaves the window, and a
            # state block two steps after it was written ("align" mode), while a background save might
            # still be reading it: save within the step that computed them
            self.cfg = dataclasses.replace(self.cfg, async_saves=False)
            log.info(
                "KVServerConnector %s: sliding-window or state groups: saves run within the step",
                role.name.lower(),
            )
        world, rank = _world_and_rank(vllm_config, role)
        client = None
        model = ""
        if layouts is not None and world is not None:
            model = _model_name(vllm_config, self.cfg)
            client = _make_client(self.cfg, model, world, rank, layouts)
        groups = len(kv_cache_config.kv_cache_groups)
        if role == KVConnectorRole.SCHEDULER:
            prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
            # vLLM's asynchronous scheduling (a GPU engine's default) plans a step before the last one's
            # results are in; a load that failed there, over a hit ending inside a block, crashed the
            # engine (tests/vllm/test_vllm_async.py): its tail hits end on a block boundary instead
            async_sched = bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))
            self._scheduler = SchedulerSide(
                self.cfg, client, block_size, groups, prefix_caching, exact, align_tails=async_sched
            )
        else:
            load_client = save_client = stream_client = None
            if (
                client is not None
                and layouts is not None
                and ((self.cfg.async_loads and self.cfg.load) or self.cfg.async_saves)
            ):
                load_client = _make_client(self.cfg, model, world or 1, rank, layouts)
            if (
                load_client is not None
                and layouts is not None
                and self.cfg.async_saves
                and self.cfg.save_policy != "none"
            ):
                save_client = _make_client(self.cfg, model, world or 1, rank, layouts)  # see loader.py
            if load_client is not None and layouts is not None and self.cfg.streams_l2():
                # see loader.py; its mapping is not populated: a deployment without L2 never uses it, and
                # the others' page tables already cost 2 MiB per GiB of arena each
                stream_client = _make_client(self.cfg, model, world or 1, rank, layouts, populate=False)
            self._worker = WorkerSide(self.cfg, client, layouts, load_client, save_client, stream_client)
        log.info(
            "KVServerConnector %s: server %s, mode %s, config layout %s (backend %s)",
            role.name.lower(),
            self.cfg.kvserver_url,
            self.cfg.mode,
            ",".join(lay.fingerprint for lay in layouts) if layouts else "unsupported",
            self._backend or "unknown",
        )
        if layouts is not None and len(layouts) > 1:
            log.info(
                "KVServerConnector %s: %d KV cache groups (hybrid manager) as object groups: %s",
                role.name.lower(),
                len(layouts),
                ", ".join(lay.kind + (f"/{lay.window}" if lay.window else "") for lay in layouts),
            )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a future miss

    # ---- scheduler side --------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """Tokens from the server's L1 (host memory) and from its L2 tiers (disk, object stores)."""
        if self._scheduler is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        tiers = {"l1": CacheHitSource.HOST, "l2": CacheHitSource.DISK}
        return {tiers[k]: v for k, v in self._scheduler.hit_sources(request, num_external_tokens).items()}

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        block_ids = [list(b) for b in blocks.get_block_ids()] if num_external_tokens > 0 else None
        self._scheduler.update_state_after_alloc(request, num_external_tokens, block_ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(
                connector_output.kv_connector_worker_meta, connector_output.finished_recving or ()
            )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, object] | None]:
        """With async_saves, vLLM keeps the blocks of a request with saves until the workers report
        it in get_finished's "finished sending" set (its saves have read them)."""
        assert self._scheduler is not None
        return self._scheduler.request_finished_delay(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, object] | None]:
        """SupportsHMA's request_finished: the delay covers the blocks of every group alike."""
        assert self._scheduler is not None
        return self._scheduler.request_finished_delay(request)

    # ---- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        if self._backend is None:  # already disabled, with the reason, when the connector started
            self._worker.enabled = False
            return
        try:
            layouts, tensors = worker_layouts(self._kv_cache_config, kv_caches, self.cfg.chunk_size, self._backend)
        except (UnsupportedLayout, ValueError) as exc:
            log.error("KVServerConnector disabled on this worker: %s", exc)
            self._worker.enabled = False
            return
        self._worker.register(layouts, tensors)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            if isinstance(connector_metadata, KVServerConnectorMetadata):
                self._worker.drain_saves(connector_metadata.preempted)
                self._worker.start_tails(connector_metadata)
            self._worker.step_started()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, KVServerConnectorMetadata)
            self._worker.start_load(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished sending, finished receiving): background saves and loads end here."""
        if self._worker is None:
            return None, None
        scheduled = 0
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            scheduled = meta.scheduled_tokens if isinstance(meta, KVServerConnectorMetadata) else 0
        return self._worker.get_finished(scheduled, set(finished_req_ids or ()))

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """get_finished's sets, and the loads that failed as whole requests: with several KV cache
        groups vLLM takes no failed block ids (they are unique per group only); it recomputes a
        request in `failed_recving` from its first token."""
        sent, received = self.get_finished(finished_req_ids)
        failed = self._worker.take_failed_requests() if self._worker is not None else set()
        return KVConnectorTransferResults(set(sent or ()), set(received or ()), failed)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finished in start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # stored once per step for all layers in wait_for_save

    def wait_for_save(self) -> None:
        if self._worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, KVServerConnectorMetadata)
            self._worker.save(meta)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.take_report() if self._worker is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks() if self._worker is not None else set()

    # ---- both ------------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVServerConnectorStats | None:
        side = self._scheduler or self._worker
        return side.stats.take() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: Mapping[str, float] | None = None) -> KVServerConnectorStats | None:
        return KVServerConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """The connector's counters as `vllm:kvserver_*` series in vLLM's own /metrics."""
        from .prom import KVServerPromMetrics

        return KVServerPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        side = self._scheduler or self._worker
        if side is not None:
            side.close()


def _model_name(vllm_config: VllmConfig, cfg: ConnectorConfig) -> str:
    """`<served name>@<fingerprint>`: the model part of every cache key (computed once, at start)."""
    mc = vllm_config.model_config
    served = getattr(mc, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    name = cfg.model_name or str(served or mc.model)
    fp, files = model_fingerprint(config_parts(vllm_config), str(mc.model), cfg.model_id)
    key = model_key_with_fingerprint(name, fp)
    if cfg.model_id is None and files == 0:
        log.warning(
            "KVServerConnector: no local weight files under %r to fingerprint; cache keys depend on "
            "the model name and config only (set kv_connector_extra_config.model_id)",
            mc.model,
        )
    log.info("KVServerConnector: model key %s (%d weight files fingerprinted)", key, files)
    return key


def _world_and_rank(vllm_config: VllmConfig, role: KVConnectorRole) -> tuple[int | None, int]:
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size > 1:
        log.error("KVServerConnector disabled: pipeline parallelism is not supported")
        return None, 0
    world = int(pc.tensor_parallel_size)
    if role == KVConnectorRole.SCHEDULER or world == 1:
        return world, 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return world, int(get_tensor_model_parallel_rank())


def _make_client(
    cfg: ConnectorConfig,
    model: str,
    world: int,
    rank: int,
    layouts: Sequence[LayoutDescriptor],
    populate: bool | None = None,
) -> EngineClient:
    from ..engine_client import EngineClient

    return EngineClient(
        cfg.kvserver_url,
        model,
        world,
        rank,
        list(layouts),
        mode=cfg.mode,
        timeout=cfg.timeout_s,
        token=cfg.token(),
        populate_arena=cfg.populate_arena if populate is None else populate and cfg.populate_arena,
        copy_backend=cfg.copy_backend,
    )
