"""Which CPU MLA backend wrote a latent cache is part of its layout fingerprint, so a host that pins
the reference backend must not be labelled as the AMX one (their engines would share bytes)."""

from __future__ import annotations

import enum
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvconnector.vllm.vllm_layout import _mla_variant


class Backend(enum.Enum):  # same str() shape as vLLM's AttentionBackendEnum: "Backend.CPU_MLA"
    CPU_MLA = "cpu_mla"
    AMX_MLA = "amx_mla"


def _config(backend: Any) -> SimpleNamespace:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        attention_config=SimpleNamespace(backend=backend),
    )


@pytest.mark.parametrize(
    ("amx", "backend", "want"),
    [
        (True, None, "amx_mla"),
        (True, Backend.AMX_MLA, "amx_mla"),
        (True, Backend.CPU_MLA, "cpu_mla"),
        (True, "CPU_MLA", "cpu_mla"),
        (False, None, "cpu_mla"),
        (False, Backend.CPU_MLA, "cpu_mla"),
    ],
)
def test_variant_follows_the_backend_vllm_runs(
    monkeypatch: pytest.MonkeyPatch, amx: bool, backend: Any, want: str
) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    assert _mla_variant(_config(backend)) == want
