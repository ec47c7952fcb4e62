"""Re-RoPE: move K computed at positions p0.. to positions p1.. by one rotation of angle (p1 - p0).

RoPE rotates each pair of K's dimensions by position x frequency, and rotations compose:
R(p1) = R(p1 - p0) R(p0). So K that was computed for a chunk standing alone (positions 0..C-1) is
made valid at its new place by rotating it by the offset, without touching V (which carries no
position). Uses the HF convention (`rotate_half`: first half / second half of the head dim).
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rerope(k: torch.Tensor, delta: int | torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """K (..., T, head_dim) rotated by `delta` positions (an int, or one per token of shape (T,)).

    `inv_freq` is the model's rotary inverse frequencies (head_dim / 2 values). Computed in float32
    and cast back, so a chunk moved far away keeps its precision.
    """
    t = k.shape[-2]
    d = torch.as_tensor(delta, dtype=torch.float32, device=k.device)
    if d.dim() == 0:
        d = d.expand(t)
    freqs = d[:, None] * inv_freq.to(device=k.device, dtype=torch.float32)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    kf = k.float()
    return (kf * emb.cos() + rotate_half(kf) * emb.sin()).to(k.dtype)
