"""Helpers for the EngineClient tests: engine-shaped KV tensors per layout tag, block comparison, and a
module-scoped real kvserver (starting one costs ~1.5 s, so tests of one module share it)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from kvconnector.layouts import flash_attn_layout, mla_layout, vllm_cpu_layout
from kvprotocol import LayoutDescriptor
from kvtestkit.serverproc import ServerProc, free_port

TAGS = ("vllm_cpu", "flash_attn", "mla")
SENTINEL = -7.25  # what untouched destination blocks hold


@dataclass(frozen=True)
class Geometry:
    tag: str
    num_layers: int = 2
    heads: int = 2
    head_dim: int = 8
    block_size: int = 16
    chunk_size: int = 64
    dtype: torch.dtype = torch.float32

    def layout(self, stacked: bool = False) -> LayoutDescriptor:
        common = {
            "num_layers": self.num_layers,
            "block_size": self.block_size,
            "dtype": self.dtype,
            "chunk_size": self.chunk_size,
            "stacked": stacked,
        }
        if self.tag == "vllm_cpu":
            return vllm_cpu_layout(num_kv_heads=self.heads, head_dim=self.head_dim, **common)
        if self.tag == "flash_attn":
            return flash_attn_layout(num_kv_heads=self.heads, head_dim=self.head_dim, **common)
        return mla_layout(latent_dim=self.heads * self.head_dim, **common)

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        if self.tag == "vllm_cpu":
            return (num_blocks, self.heads, self.block_size, 2 * self.head_dim)
        if self.tag == "flash_attn":
            return (2, num_blocks, self.block_size, self.heads, self.head_dim)
        return (num_blocks, self.block_size, self.heads * self.head_dim)

    def random_kv(self, num_blocks: int, seed: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(self.layer_shape(num_blocks), generator=g).to(self.dtype) for _ in range(self.num_layers)]

    def sentinel_kv(self, num_blocks: int) -> list[torch.Tensor]:
        return [torch.full(self.layer_shape(num_blocks), SENTINEL, dtype=self.dtype) for _ in range(self.num_layers)]


def block_of(tag: str, layer: torch.Tensor, block: int) -> torch.Tensor:
    """One block of one layer, whatever the tag's block axis."""
    return layer[:, block] if tag == "flash_attn" else layer[block]


def untouched(tag: str, layer: torch.Tensor, block: int) -> bool:
    return bool((block_of(tag, layer, block) == SENTINEL).all())


def module_server(*args: str) -> object:
    """A module-scoped fixture that runs one real kvserver with the given flags."""

    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
        log = tmp_path_factory.mktemp("kvserver") / "kvserver.log"
        proc = ServerProc(free_port(), list(args), log).start()
        yield proc
        proc.stop()

    return fixture
