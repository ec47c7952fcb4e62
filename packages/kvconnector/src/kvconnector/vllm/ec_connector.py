"""KVServerECConnector: vLLM 0.32's encoder-cache connector (ECConnectorBase) backed by a kvserver.

    LLM(..., ec_transfer_config={
        "ec_connector": "KVServerECConnector", "ec_connector_module_path": "kvconnector.vllm",
        "ec_role": "ec_both", "ec_connector_extra_config": {"kvserver_url": "tcp://127.0.0.1:5555"}})

A second engine that sees an image another engine already encoded loads its encoder output from
the server instead of running the vision tower (docs/multimodal.md). Scheduler side: `has_cache_item`
asks the server and leases each hit (one reader per TP rank), so it cannot be evicted before the
workers read it; `update_state_after_alloc` turns the promised items into loads. Worker side: loads
verify the checksum, dtype and shape; saves come from rank 0 only (TP ranks compute bit-identical
encoder outputs: stored once). A load that fails after the scheduler promised it is handed back to
vLLM's model runner to encode in the same step (see `_encode_instead`): a failure costs an encoder
run, never wrong output and never a failed request.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from types import FrameType
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorMetadata, ECConnectorRole

from ..ec_client import ECClient, ECDescriptor
from .config import parse_config
from .ec_keys import ec_item, ec_model_and_space
from .ec_stats import KVServerECStats, StatDelta, build_stats
from .log import log

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

REUSE_S = 2.0  # a positive answer (and its lease) is reused this long without asking again
KV_ONLY_KEYS = ("chunk_size", "save_policy", "debug_fail_load_chunks", "debug_fail_plan_loads")


@dataclass
class ECLoad:
    mm_hash: str
    num_embeds: int
    req_id: str
    input_id: int
    desc: ECDescriptor  # a plain map


@dataclass
class KVServerECMetadata(ECConnectorMetadata):
    loads: list[ECLoad] = field(default_factory=list)


class KVServerECConnector(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        tc = vllm_config.ec_transfer_config
        assert tc is not None
        extra = dict(tc.ec_connector_extra_config)
        self._debug_fail_loads = bool(extra.pop("debug_fail_loads", False))  # TEST ONLY: every load fails
        bad = sorted(set(extra) & set(KV_ONLY_KEYS))
        if bad:
            raise ValueError(f"KVServerECConnector: {bad} are KV connector options")
        cfg = parse_config(extra)
        model, space = ec_model_and_space(vllm_config, cfg.model_name, cfg.model_id)
        pc = vllm_config.parallel_config
        self._world = int(pc.tensor_parallel_size)
        self._rank = 0
        if role == ECConnectorRole.WORKER and self._world > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._rank = int(get_tensor_model_parallel_rank())
        self.client = ECClient(
            cfg.kvserver_url,
            model,
            space,
            mode=cfg.mode,
            timeout=cfg.timeout_s,
            retry_after_s=cfg.retry_after_s,
            token=cfg.token(),
        )
        self._promised: dict[str, tuple[float, ECDescriptor]] = {}  # scheduler: mm_hash -> (when, leased desc)
        self._loads: list[ECLoad] = []
        self._stats = StatDelta()  # scheduler side: what vLLM's stat loggers get (ec_stats.py)
        self.encoded_instead = 0  # worker: promised loads that failed and were encoded in the same step
        log.info(
            "KVServerECConnector %s: server %s, model %s, space %s, role %s",
            role.name.lower(),
            cfg.kvserver_url,
            model,
            space,
            tc.ec_role,
        )

    # -- scheduler side ----------------------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        if not self.is_consumer:
            return False
        now = time.monotonic()
        seen = self._promised.get(identifier)
        if seen is not None and now - seen[0] < REUSE_S:
            return True
        desc = self.client.lookup([ec_item(identifier)], readers=self._world)[0]
        self._stats.add("ec_lookups")
        if desc is None:
            self._promised.pop(identifier, None)
            return False
        self._promised[identifier] = (now, desc)
        self._stats.add("ec_hits")
        return True

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        mm_hash = request.mm_features[index].identifier
        seen = self._promised.pop(mm_hash, None)
        if seen is None or not self.is_consumer:
            return  # encoded locally
        self._stats.add("ec_loads_planned")
        self._loads.append(
            ECLoad(mm_hash, int(request.get_num_encoder_embeds(index)), request.request_id, index, seen[1])
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        meta = KVServerECMetadata(self._loads)
        self._loads = []
        return meta

    def get_ec_connector_stats(self) -> KVServerECStats | None:
        return self._stats.take()

    @classmethod
    def build_ec_connector_stats(cls, data: Mapping[str, float] | None = None) -> KVServerECStats | None:
        return build_stats(data)

    # -- worker side -------------------------------------------------------------------------------
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVServerECMetadata)
        failed: list[ECLoad] = []
        for load in meta.loads:
            if load.mm_hash not in encoder_cache:
                tensor = None if self._debug_fail_loads else self._load(load)
                if tensor is None:
                    failed.append(load)
                else:
                    encoder_cache[load.mm_hash] = tensor
            if "lease" in load.desc:
                self.client.release(str(load.desc["lease"]))
        if failed:
            self._encode_instead(failed)

    def _load(self, load: ECLoad) -> torch.Tensor | None:
        got = self.client.load(ec_item(load.mm_hash), load.desc)
        if got is None:
            return None
        data, dtype, shape = got
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype) or not shape or shape[0] != load.num_embeds:
            log.error(
                "kvserver EC item %s: stored as %s %s, the request needs %d embeddings; encoding instead",
                load.mm_hash,
                dtype,
                shape,
                load.num_embeds,
            )
            return None
        try:
            tensor = torch.from_numpy(data).view(torch_dtype).reshape(shape)
        except RuntimeError as exc:
            log.error(
                "kvserver EC item %s: cannot view %d bytes as %s %s (%s)", load.mm_hash, data.nbytes, dtype, shape, exc
            )
            return None
        from vllm.platforms import current_platform

        device = current_platform.device_type
        if current_platform.is_cuda_alike():
            device = f"{device}:{current_platform.current_device()}"
        return tensor.to(device)

    def _encode_instead(self, failed: list[ECLoad]) -> None:
        """Make vLLM's model runner encode the items whose load failed, in this same step.

        vLLM 0.32 calls start_load_caches from the model runner's `_get_ec_connector_output`, whose
        frame holds this step's SchedulerOutput; the runner reads `scheduled_encoder_inputs` from it
        right after, so adding the failed items there makes it run the encoder for them. Without that
        frame (another vLLM version), raise: vLLM would fail on the missing encoder output anyway.
        """
        frame: FrameType | None = sys._getframe(1)
        output = None
        for _ in range(6):
            if frame is None:
                break
            candidate = frame.f_locals.get("scheduler_output")
            if candidate is not None and isinstance(getattr(candidate, "scheduled_encoder_inputs", None), dict):
                output = candidate
                break
            frame = frame.f_back
        if output is None:
            raise RuntimeError(
                "KVServerECConnector: encoder outputs promised by the scheduler could not be "
                f"loaded ({[x.mm_hash for x in failed]}) and this vLLM version offers no way to "
                "encode them instead"
            )
        for load in failed:
            inputs = output.scheduled_encoder_inputs.setdefault(load.req_id, [])
            if load.input_id not in inputs:
                inputs.append(load.input_id)
        self.encoded_instead += len(failed)
        log.warning("kvserver EC: %d promised encoder outputs could not be loaded; encoding them instead", len(failed))

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        if not self.is_producer or self._rank != 0:  # TP ranks hold identical outputs: rank 0 stores
            return
        tensor = encoder_cache[mm_hash].detach().to("cpu").contiguous()
        shape = list(tensor.shape)
        dtype = str(tensor.dtype).removeprefix("torch.")
        raw = tensor.reshape(-1).view(torch.uint8).numpy()
        self.client.save(ec_item(mm_hash), raw, dtype, shape)

    def shutdown(self) -> None:
        self.client.close()
