"""The KV shape a bench pretends to cache, as the layout descriptor an engine would register."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvprotocol import DTYPES, LayoutDescriptor


@dataclass(frozen=True, slots=True)
class KVShape:
    layers: int = 4
    kv_heads: int = 4
    head_dim: int = 64
    dtype: str = "float16"
    block_size: int = 32

    def layout(self, chunk_size: int) -> LayoutDescriptor:
        """vLLM-CPU style: per layer and block, [kv_heads, block_size, 2 * head_dim] (K and V together)."""
        shape = (self.kv_heads, self.block_size, 2 * self.head_dim)
        block_bytes = self.kv_heads * self.block_size * 2 * self.head_dim * DTYPES[self.dtype]
        return LayoutDescriptor(
            tag="vllm_cpu",
            dtype=self.dtype,
            num_layers=self.layers,
            block_size=self.block_size,
            block_bytes=block_bytes,
            chunk_size=chunk_size,
            block_shape=shape,
        )

    def describe(self, chunk_size: int) -> dict[str, Any]:
        layout = self.layout(chunk_size)
        return {
            "layers": self.layers,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "chunk_size": chunk_size,
            "object_bytes": layout.object_bytes,
            "bytes_per_token": layout.object_bytes // chunk_size,
            "layout_fingerprint": layout.fingerprint,
        }
