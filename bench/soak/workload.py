"""The soak's workload: shared-prefix prompts and block contents that are a pure function of the
object's identity, so any process can check any loaded byte without a shared reference store."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from kvconnector.layouts import flash_attn_layout, vllm_cpu_layout
from kvprotocol import LayoutDescriptor

MODEL = "soak/model"
CHUNK = 64
BLOCK = 16
BLOCKS_PER_CHUNK = CHUNK // BLOCK
LAYERS, HEADS, HEAD_DIM = 2, 2, 8
PREFIXES, PREFIX_CHUNKS = 6, 2
SUFFIXES, SUFFIX_CHUNKS = 24, 3
MAX_CHUNKS = PREFIX_CHUNKS + SUFFIX_CHUNKS
MAX_BLOCKS = MAX_CHUNKS * BLOCKS_PER_CHUNK
SENTINEL = -7.25


def layout(tag: str) -> LayoutDescriptor:
    if tag in ("vllm_cpu", "flash_attn"):
        make = vllm_cpu_layout if tag == "vllm_cpu" else flash_attn_layout
        return make(
            num_kv_heads=HEADS,
            head_dim=HEAD_DIM,
            num_layers=LAYERS,
            block_size=BLOCK,
            dtype=torch.float32,
            chunk_size=CHUNK,
        )
    raise ValueError(f"unknown layout tag {tag}")


def layer_shape(tag: str, num_blocks: int) -> tuple[int, ...]:
    if tag == "vllm_cpu":
        return (num_blocks, HEADS, BLOCK, 2 * HEAD_DIM)
    return (2, num_blocks, BLOCK, HEADS, HEAD_DIM)


def block_view(tag: str, layer: torch.Tensor, block: int) -> torch.Tensor:
    return layer[:, block] if tag == "flash_attn" else layer[block]


def prompt(prefix: int, suffix: int, suffix_chunks: int) -> np.ndarray:
    """Tokens of one prompt: a prefix shared by many prompts, then its own suffix (whole chunks only,
    plus a ragged tail the cache never stores)."""
    head = np.random.default_rng([1, prefix]).integers(0, 50_000, PREFIX_CHUNKS * CHUNK)
    tail = np.random.default_rng([2, prefix, suffix]).integers(0, 50_000, suffix_chunks * CHUNK + 17)
    return np.concatenate([head, tail]).astype(np.int64)


@dataclass(frozen=True)
class Identity:
    """What names an object besides its tokens: the same prompt under another tenant, layout, world
    size or rank is another object, so its bytes differ too (a cross-tenant leak reads as wrong bytes)."""

    tenant: str
    tag: str
    world: int
    rank: int

    def chunk_blocks(self, tokens: np.ndarray, chunk: int) -> list[list[np.ndarray]]:
        """Expected content of chunk `chunk`: [layer][block in chunk] -> flat float32 values."""
        h = hashlib.blake2b(f"{self.tenant}|{self.tag}|{self.world}|{self.rank}".encode(), digest_size=16)
        h.update(np.ascontiguousarray(tokens[: (chunk + 1) * CHUNK], dtype="<u4").tobytes())
        seed = int.from_bytes(h.digest(), "little")
        n = int(np.prod(layer_shape(self.tag, 1)))
        rng = np.random.default_rng(seed)
        return [[rng.standard_normal(n, dtype=np.float32) for _ in range(BLOCKS_PER_CHUNK)] for _ in range(LAYERS)]

    def fill(self, kv: list[torch.Tensor], tokens: np.ndarray, chunks: int, first_block: int) -> None:
        for c in range(chunks):
            for layer, blocks in zip(kv, self.chunk_blocks(tokens, c), strict=True):
                for j, values in enumerate(blocks):
                    view = block_view(self.tag, layer, first_block + c * BLOCKS_PER_CHUNK + j)
                    view.copy_(torch.from_numpy(values).reshape(view.shape))

    def wrong_blocks(self, kv: list[torch.Tensor], tokens: np.ndarray, chunks: int, first_block: int) -> int:
        """Blocks of chunks [0, chunks) that differ from the reference, plus blocks after them that a
        load should not have touched but did."""
        wrong = 0
        for c in range(chunks):
            for layer, blocks in zip(kv, self.chunk_blocks(tokens, c), strict=True):
                for j, values in enumerate(blocks):
                    view = block_view(self.tag, layer, first_block + c * BLOCKS_PER_CHUNK + j)
                    wrong += not torch.equal(view.reshape(-1), torch.from_numpy(values))
        for layer in kv:
            for b in range(first_block + chunks * BLOCKS_PER_CHUNK, first_block + MAX_BLOCKS):
                wrong += not bool((block_view(self.tag, layer, b) == SENTINEL).all())
        return wrong
