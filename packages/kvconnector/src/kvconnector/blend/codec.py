"""One blend chunk's K/V (every layer) as the bytes of one cache object, and back.

Object format: [layer][K, V][token][kv_head][head_dim], contiguous, in the model's dtype; described to
the server as a `flash_attn` layout with one block per chunk, so a change of model shape or dtype
changes the layout fingerprint and old bytes are never served.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvprotocol import LayoutDescriptor

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class ChunkCodec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    chunk_size: int
    dtype: torch.dtype = torch.float32

    @property
    def layout(self) -> LayoutDescriptor:
        c, h, d = self.chunk_size, self.num_kv_heads, self.head_dim
        item = torch.empty((), dtype=self.dtype).element_size()
        return LayoutDescriptor(
            "flash_attn",
            _DTYPES[self.dtype],
            self.num_layers,
            c,
            2 * c * h * d * item,
            c,
            (2, c, h, d),
            variant="blend",
        )

    def encode(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> bytes:
        """k, v: one (kv_heads, chunk_size, head_dim) tensor per layer (HF's per-layer cache layout)."""
        if len(k) != self.num_layers or len(v) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} layers")
        stacked = torch.stack([torch.stack((kl, vl)) for kl, vl in zip(k, v)])  # (L, 2, H, C, D)
        if tuple(stacked.shape[2:]) != (self.num_kv_heads, self.chunk_size, self.head_dim):
            raise ValueError(f"bad chunk KV shape {tuple(stacked.shape)}")
        out = stacked.to(self.dtype).transpose(2, 3).contiguous().cpu()  # (L, 2, C, H, D)
        return out.view(torch.uint8).numpy().tobytes()

    def decode(self, data: bytes | memoryview) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Inverse of encode: per-layer K and V of shape (kv_heads, chunk_size, head_dim)."""
        shape = (self.num_layers, 2, self.chunk_size, self.num_kv_heads, self.head_dim)
        flat = torch.frombuffer(bytearray(data), dtype=self.dtype)
        if flat.numel() != self.num_layers * 2 * self.chunk_size * self.num_kv_heads * self.head_dim:
            raise ValueError("object has the wrong size for this codec")
        t = flat.view(shape).transpose(2, 3)  # (L, 2, H, C, D)
        return [t[layer, 0] for layer in range(self.num_layers)], [t[layer, 1] for layer in range(self.num_layers)]
