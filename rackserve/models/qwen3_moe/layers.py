"""Qwen3-MoE's small layers: RMS norm and rotary position embedding, computed as the reference does.
Shapes: T tokens, H heads, d head_dim."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) in fp32, cast back to x's dtype, times a weight in the model dtype (the reference's order)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel for x / rms(x): one op where the spelt-out formula is four (a decode step's
        # norms are small, so their cost is the ops' count)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class Rotary:
    """Plain RoPE over the whole head: channel pairs (i, i + d/2) rotate by position · theta^(-2i/d)."""

    def __init__(self, head_dim: int, theta: float, device: torch.device):
        # on the CPU, then moved, as the reference computes it: the same bits on every device
        self.inv_freq = (1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions `[T]` -> cos, sin `[T, 1, d]` in `dtype` (angles in fp32), once per forward for every layer."""
        freqs = positions[:, None].float() * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[T, H, d]` rotated by `Rotary.cos_sin`'s angles."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
