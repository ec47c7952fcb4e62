"""The identity of an encoder output in the kvserver's EC namespace: (model, space, item).

- model: `<served name>@<fingerprint>` over the config that changes encoder outputs (model,
  revision, dtype, quantization) and the weight files, like KV keys (fingerprint.py), but without
  the KV cache dtype: switching KV quantisation must not invalidate every encoder output.
- space: 16 hex chars over the encoder output's dtype (the model's dtype, from its config) and the
  key scheme, with world size and rank folded to sentinels ("*"): TP ranks compute bit-identical
  encoder outputs, so one object serves every rank of every engine.
- item: vLLM's multimodal identifier (`mm_hash`, a content hash), or a digest of it when it holds
  characters the protocol does not take (client-provided UUIDs may).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from blake3 import blake3

from .fingerprint import model_fingerprint, model_key_with_fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_ITEM_RE = re.compile(r"^[A-Za-z0-9._:@+=/-]{1,200}$")


def ec_config_parts(vllm_config: VllmConfig) -> dict[str, str]:
    mc = vllm_config.model_config
    return {
        "model": str(mc.model),
        "revision": str(getattr(mc, "revision", None)),
        "dtype": str(getattr(mc, "dtype", None)),
        "quantization": str(getattr(mc, "quantization", None)),
        "cache": "encoder",
    }


def ec_space(dtype: str) -> str:
    return blake3(
        json.dumps({"scheme": "ec-v1", "dtype": dtype, "world": "*", "rank": "*"}, sort_keys=True).encode()
    ).hexdigest()[:16]


def ec_model_and_space(vllm_config: VllmConfig, model_name: str | None, model_id: str | None) -> tuple[str, str]:
    mc = vllm_config.model_config
    served = getattr(mc, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    name = model_name or str(served or mc.model)
    parts = ec_config_parts(vllm_config)
    fp, _ = model_fingerprint(parts, str(mc.model), model_id)
    return model_key_with_fingerprint(name, fp), ec_space(parts["dtype"])


def ec_item(identifier: str) -> str:
    if _ITEM_RE.match(identifier):
        return identifier
    return "h:" + blake3(identifier.encode()).hexdigest()
