"""Reference correctness: a small attention model with a paged KV cache in the vLLM-CPU layout.

Prefill prompt A and save its KV through the EngineClient; then, in a fresh cache with another
block assignment, load the prefix prompt B shares with A, compute the rest of B, and compare with a
full recompute of B: logits and KV must be bitwise equal. The model runs prefill in steps on the chunk
grid and always attends over K/V gathered from the paged cache, so the suffix computation is exactly
the one a full run does; the only difference is where the prefix K/V came from.
"""

from __future__ import annotations
from kvtestkit.kvhelpers import sid

import math

import numpy as np
import pytest
import torch

from engine_kv_helpers import module_server
from kvconnector.engine_client import EngineClient
from kvconnector.layouts import vllm_cpu_layout

CHUNK, BLOCK = 64, 16
LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 3, 32, 4, 2, 8, 64, 101


class PagedModel:
    """A Llama-like decoder (RMSNorm, RoPE, GQA attention, SiLU MLP) over a paged KV cache
    [num_blocks, kv_heads, block_size, 2 * head_dim] per layer (K in the first half, V in the second)."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / math.sqrt(shape[0])

        self.embed = torch.randn(VOCAB, HIDDEN, generator=g)
        self.layers = [
            {
                "q": w(HIDDEN, HEADS * HEAD_DIM),
                "k": w(HIDDEN, KV_HEADS * HEAD_DIM),
                "v": w(HIDDEN, KV_HEADS * HEAD_DIM),
                "o": w(HEADS * HEAD_DIM, HIDDEN),
                "up": w(HIDDEN, FFN),
                "down": w(FFN, HIDDEN),
            }
            for _ in range(LAYERS)
        ]
        self.head = w(HIDDEN, VOCAB)

    @staticmethod
    def new_cache(num_blocks: int, fill: float = 0.0) -> list[torch.Tensor]:
        return [torch.full((num_blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM), fill) for _ in range(LAYERS)]

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    @staticmethod
    def _rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # x [M, heads, HEAD_DIM]
        half = HEAD_DIM // 2
        freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
        ang = pos[:, None, None].float() * freq
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()], -1)

    def forward(self, tokens: np.ndarray, cache: list[torch.Tensor], table: list[int], start: int) -> torch.Tensor:
        """Compute positions [start, len) in steps on the chunk grid; returns their logits."""
        assert start % CHUNK == 0
        out = []
        for s in range(start, len(tokens), CHUNK):
            e = min(s + CHUNK, len(tokens))
            out.append(self._step(torch.as_tensor(tokens[s:e]), s, e, cache, table))
        return torch.cat(out)

    def _step(self, toks: torch.Tensor, s: int, e: int, cache: list[torch.Tensor], table: list[int]) -> torch.Tensor:
        m = e - s
        pos = torch.arange(s, e)
        blocks = torch.tensor(table)[torch.arange(e) // BLOCK]
        slots = torch.arange(e) % BLOCK
        x = self.embed[toks]
        mask = torch.arange(e)[None, :] > pos[:, None]  # causal: key position after query position
        for kv, p in zip(cache, self.layers, strict=True):
            h = self._norm(x)
            q = self._rope((h @ p["q"]).view(m, HEADS, HEAD_DIM), pos)
            k = self._rope((h @ p["k"]).view(m, KV_HEADS, HEAD_DIM), pos)
            v = (h @ p["v"]).view(m, KV_HEADS, HEAD_DIM)
            kv[blocks[s:], :, slots[s:]] = torch.cat([k, v], -1)  # write this step's K/V into its slots
            gathered = kv[blocks, :, slots]  # [e, KV_HEADS, 2*HEAD_DIM]: K/V of positions 0..e-1
            keys = gathered[..., :HEAD_DIM].repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
            vals = gathered[..., HEAD_DIM:].repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
            scores = q.transpose(0, 1) @ keys.transpose(1, 2) / math.sqrt(HEAD_DIM)
            attn = torch.softmax(scores.masked_fill(mask, float("-inf")), -1) @ vals  # [HEADS, m, HEAD_DIM]
            x = x + attn.transpose(0, 1).reshape(m, HEADS * HEAD_DIM) @ p["o"]
            x = x + torch.nn.functional.silu(self._norm(x) @ p["up"]) @ p["down"]
        return self._norm(x) @ self.head


def kv_of(cache: list[torch.Tensor], table: list[int], n: int) -> torch.Tensor:
    """Every layer's K/V of positions 0..n-1, read through the block table."""
    idx = torch.arange(n)
    return torch.stack([kv[torch.tensor(table)[idx // BLOCK], :, idx % BLOCK] for kv in cache])


LAYOUT = vllm_cpu_layout(
    num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK, dtype=torch.float32, chunk_size=CHUNK
)


kv_server = module_server("--l1-size-gb", "0.05", "--chunk-size", str(CHUNK))


@pytest.mark.parametrize("mode", ["shm", "tcp"])
def test_loaded_prefix_gives_bitwise_equal_logits(kv_server, mode: str) -> None:
    server = kv_server
    model = PagedModel()
    rng = np.random.default_rng(3 if mode == "shm" else 4)  # the modes must not share objects
    prompt_a = rng.integers(0, VOCAB, 3 * CHUNK + 20)
    prompt_b = np.concatenate([prompt_a[: 2 * CHUNK + 30], rng.integers(0, VOCAB, 92)])  # shares 2 chunks
    nb = 24

    cache_a, table_a = PagedModel.new_cache(nb), [int(b) for b in rng.permutation(nb)[:14]]
    with EngineClient(server.url, "ref/tiny", 1, 0, [LAYOUT], mode=mode) as engine:
        assert engine.register(cache_a)
        model.forward(prompt_a, cache_a, table_a, 0)
        assert engine.save(prompt_a, table_a).saved_chunks == 3

    # a new engine: NaN-filled cache (an unloaded slot would poison the logits), other blocks
    cache_b, table_b = PagedModel.new_cache(nb, float("nan")), [int(b) for b in rng.permutation(nb)[:16]]
    with EngineClient(server.url, "ref/tiny", 1, 0, [LAYOUT], mode=mode) as engine:
        assert engine.register(cache_b)
        hit = engine.lookup(prompt_b, session=sid("req-b")).hit_tokens
        assert hit == 2 * CHUNK
        assert engine.load(sid("req-b"), prompt_b, table_b, 0, hit).ok
        engine.release(sid("req-b"))
        partial = model.forward(prompt_b, cache_b, table_b, hit)

    cache_full, table_full = PagedModel.new_cache(nb), [int(b) for b in rng.permutation(nb)[:16]]
    full = model.forward(prompt_b, cache_full, table_full, 0)

    assert torch.equal(partial, full[hit:])  # bitwise, every computed position including the last
    assert torch.equal(kv_of(cache_b, table_b, len(prompt_b)), kv_of(cache_full, table_full, len(prompt_b)))

    # control: the same suffix computation without the load is not equal (the check can fail)
    cold = PagedModel.new_cache(nb, float("nan"))
    assert not torch.equal(model.forward(prompt_b, cold, table_b, hit), full[hit:])
