"""Interleaved partial RoPE of DeepSeek-V4 (plain and YaRN), rotating the trailing channels of a head.

Consecutive channel pairs (2i, 2i+1) of the last `dim` channels rotate by `pos · inv_freq[i]`; the
leading `head_dim - dim` channels pass through. V4 shares K and V, so attention outputs carry the
keys' rotation and are rotated back by the conjugate (`inverse=True`) at the query position.
"""

from __future__ import annotations

import math

import torch

from rackserve.models.deepseek_v4.config import RopeConfig


def inv_freq_and_scale(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[dim // 2]` (fp32) and the cos/sin scale, as the reference computes them."""
    dim, base = rope.dim, rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0

    factor = rope.factor
    assert factor is not None and rope.original_max_position_embeddings is not None

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    # The correction range is truncated to whole dimensions (the reference's default).
    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class Rotary:
    """cos/sin tables for one `RopeConfig`, computed on the fly for arbitrary positions."""

    def __init__(self, rope: RopeConfig, device: torch.device | str = "cpu"):
        inv_freq, self.scale = inv_freq_and_scale(rope)
        self.inv_freq = inv_freq.to(device)
        self.dim = rope.dim

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`positions [N]` (int) -> cos, sin `[N, dim // 2]` in `dtype` (rounded like the reference)."""
        freqs = positions[:, None].float() * self.inv_freq
        return (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)


class Rotaries:
    """One `Rotary` per rope config and device, made on first use (a model asks for its layers' ropes
    on every forward)."""

    def __init__(self):
        self._made: dict[RopeConfig, Rotary] = {}

    def get(self, rope: RopeConfig, device: torch.device) -> Rotary:
        made = self._made.get(rope)
        if made is None or made.inv_freq.device != device:
            made = self._made[rope] = Rotary(rope, device)
        return made


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing `2 * cos.shape[-1]` channels of `x`.

    x: `[N, ..., head_dim]`; cos, sin: `[N, dim // 2]` (broadcast over the middle axes).
    `inverse` rotates by the conjugate angle. Computed in fp32, returned in `x.dtype`.
    """
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1] * 2,)
    cos = cos.repeat_interleave(2, dim=-1).view(shape)
    sin = sin.repeat_interleave(2, dim=-1).view(shape)
    if inverse:
        sin = -sin
    rd = cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:]
    # rotate_half on interleaved pairs: (x0, x1) -> (-x1, x0)
    rotated_half = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + rotated_half.float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)
