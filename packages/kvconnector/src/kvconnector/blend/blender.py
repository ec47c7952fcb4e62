"""The CacheBlend prefill over a Llama-style torch model (HF transformers: q/k/v/o projections, RMSNorm,
rotary embedding): reuse cached chunks at new positions and recompute only the tokens that need it.

Why it works, and why it is approximate: a document's KV computed alone differs from its KV in the
prompt only through attention to what came before it (cross-chunk attention). Layer 0's KV depends
on the token and its position alone, so after re-RoPE it is exact. From layer 1 on it deviates; the
tokens whose layer-1 K/V deviate most are the ones whose later layers deviate most too (CacheBlend's
observation), so recomputing those few, from the check layer on, restores most of the cross-chunk
attention. Every other reused token keeps its loaded KV. The result is close to a full recompute,
not equal to it; the exact prefix path (EngineClient) never comes here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .rope import rerope, rotate_half

if TYPE_CHECKING:
    from transformers import Cache, PreTrainedModel


@dataclass
class ReusedChunk:
    """Cached KV of tokens [start, start + C) of the prompt, computed at positions ref_pos.."""

    start: int
    ref_pos: int
    k: Sequence[torch.Tensor]  # per layer (kv_heads, C, head_dim)
    v: Sequence[torch.Tensor]


@dataclass
class BlendOutcome:
    logits: torch.Tensor  # (vocab,) next-token logits after the prompt
    cache: Cache  # a transformers DynamicCache holding the blended KV: decode continues from it
    reused_tokens: int  # tokens covered by loaded chunks
    recomputed_tokens: int  # of those, recomputed from the check layer on
    flops: float  # prefill FLOPs spent (projections, MLP and attention; embeddings and head excluded)
    full_flops: float  # the same prompt fully recomputed

    @property
    def saved(self) -> float:
        """Fraction of the prefill compute saved against a full recompute."""
        return 1.0 - self.flops / self.full_flops if self.full_flops else 0.0


class _Shapes:
    def __init__(self, model: Any) -> None:
        cfg = model.config
        self.layers = model.model.layers
        self.hidden = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.inter = cfg.intermediate_size
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.kv_flops = 2.0 * 2 * self.hidden * kv  # k and v projections of one token
        self.lin_flops = 2.0 * (2 * self.hidden * q + 3 * self.hidden * self.inter) + self.kv_flops

    def attn_flops(self, positions: torch.Tensor) -> float:
        """QK^T and AV of queries at these positions over their causal context."""
        return float(4.0 * self.heads * self.head_dim * (positions.double() + 1).sum())


def _qkv(
    attn: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, s: _Shapes, want_q: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    t = x.shape[0]
    k = attn.k_proj(x).view(t, s.kv_heads, s.head_dim).transpose(0, 1)
    v = attn.v_proj(x).view(t, s.kv_heads, s.head_dim).transpose(0, 1)
    k = k * cos + rotate_half(k) * sin
    if not want_q:
        return None, k, v
    q = attn.q_proj(x).view(t, s.heads, s.head_dim).transpose(0, 1)
    return q * cos + rotate_half(q) * sin, k, v


def _attend(
    attn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, s: _Shapes
) -> torch.Tensor:
    """Queries (heads, Tq, D) at positions q_pos over the whole prompt's K/V (kv_heads, N, D), causal."""
    groups = s.heads // s.kv_heads
    k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
    mask = torch.arange(k.shape[1], device=q.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask[None, None], scale=attn.scaling)
    return attn.o_proj(out[0].transpose(0, 1).reshape(q.shape[1], s.heads * s.head_dim))


def _finish_layer(layer: Any, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    h = h + attn_out
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _make_cache(model: Any, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> Any:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for layer, (k, v) in enumerate(zip(ks, vs, strict=True)):
        cache.update(k[None], v[None], layer)
    return cache


@torch.no_grad()
def full_prefill(model: PreTrainedModel, input_ids: torch.Tensor) -> BlendOutcome:
    """The reference: the model's own forward over the whole prompt."""
    s = _Shapes(model)
    out = model(input_ids[None], use_cache=True)
    n = input_ids.shape[0]
    flops = len(s.layers) * (n * s.lin_flops + s.attn_flops(torch.arange(n)))
    return BlendOutcome(out.logits[0, -1], out.past_key_values, 0, 0, flops, flops)


@torch.no_grad()
def blend_prefill(
    model: PreTrainedModel,  # Llama-style: model.layers of self_attn (q/k/v/o_proj) and mlp, rotary_emb
    input_ids: torch.Tensor,
    chunks: Sequence[ReusedChunk],
    recompute_ratio: float,
    *,
    check_layer: int = 1,
    reuse_only: bool = False,
) -> BlendOutcome:
    """Prefill `input_ids` (1-D) reusing `chunks`, recomputing `recompute_ratio` of the reused tokens.

    Tokens no chunk covers are always computed; so is the last token (its logits are the answer). With
    `reuse_only`, nothing reused is recomputed and no layer is computed in full (the lower bound).
    """
    if not 0.0 <= recompute_ratio <= 1.0:
        raise ValueError("recompute_ratio must be in [0, 1]")
    s = _Shapes(model)
    dev = input_ids.device
    n, n_layers = input_ids.shape[0], len(s.layers)
    dtype = model.model.embed_tokens.weight.dtype
    reused = torch.zeros(n, dtype=torch.bool, device=dev)
    kr = [torch.zeros(s.kv_heads, n, s.head_dim, dtype=dtype, device=dev) for _ in range(n_layers)]
    vr = [torch.zeros_like(t) for t in kr]
    inv_freq = model.model.rotary_emb.inv_freq
    for ch in chunks:
        c = ch.k[0].shape[1]
        if ch.start < 0 or ch.start + c > n - 1 or bool(reused[ch.start : ch.start + c].any()):
            continue  # never the last token, never overlapping: such a chunk is simply not reused
        for layer in range(n_layers):
            kr[layer][:, ch.start : ch.start + c] = rerope(ch.k[layer].to(dev, dtype), ch.start - ch.ref_pos, inv_freq)
            vr[layer][:, ch.start : ch.start + c] = ch.v[layer].to(dev, dtype)
        reused[ch.start : ch.start + c] = True
    positions = torch.arange(n, device=dev)
    h = model.model.embed_tokens(input_ids)
    cos, sin = (t[0] for t in model.model.rotary_emb(h[None], positions[None]))
    check = -1 if reuse_only else min(check_layer, n_layers)  # layers before it are computed in full
    sel = positions[~reused] if reuse_only else positions
    h = h[sel]
    flops, ks, vs = 0.0, [], []
    n_reused = int(reused.sum())
    for li, layer in enumerate(s.layers):
        attn = layer.self_attn
        if li <= check:
            x = layer.input_layernorm(h)  # h covers every token here
            q, k, v = _qkv(attn, x, cos, sin, s, want_q=li < check)
            if li == check:  # select: the reused tokens whose fresh K/V deviate most from the loaded ones
                deviation = ((k - kr[li]) ** 2).sum(dim=(0, 2)) + ((v - vr[li]) ** 2).sum(dim=(0, 2))
                n_sel = round(recompute_ratio * n_reused)
                top = torch.topk(deviation.masked_fill(~reused, float("-inf")), n_sel).indices if n_sel else sel[:0]
                sel = torch.sort(torch.cat((positions[~reused], top))).values
                h = h[sel]
                q, _, _ = _qkv(attn, x[sel], cos[sel], sin[sel], s)
                flops += n * s.kv_flops + len(sel) * (s.lin_flops - s.kv_flops)
            else:
                flops += n * s.lin_flops
            assert q is not None
            h = _finish_layer(layer, h, _attend(attn, q, k, v, sel, s))
        else:  # only the selected tokens; everyone else keeps the loaded (re-RoPE'd) KV
            x = layer.input_layernorm(h)
            q, k_sel, v_sel = _qkv(attn, x, cos[sel], sin[sel], s)
            k, v = kr[li].clone(), vr[li].clone()
            k[:, sel], v[:, sel] = k_sel, v_sel
            assert q is not None
            h = _finish_layer(layer, h, _attend(attn, q, k, v, sel, s))
            flops += len(sel) * s.lin_flops
        flops += s.attn_flops(sel)
        ks.append(k)
        vs.append(v)
    logits = model.lm_head(model.model.norm(h[-1:]))[0]
    full = n_layers * (n * s.lin_flops + s.attn_flops(positions))
    recomputed = len(sel) - int((~reused).sum())
    return BlendOutcome(logits, _make_cache(model, ks, vs), n_reused, recomputed, flops, full)
