"""Small building blocks of DeepSeek-V4: RMS norms and the mHC residual streams.

Shapes: T = tokens in the ragged batch, N = `hc_mult` residual streams, D = hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMS norm with an fp32 weight; normalises in fp32 and returns the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm without a weight over the last axis (per-head query norm, mHC input norm)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """mHC around one block: collapses N streams into the block input and mixes them back.

    From the streams `[T, N, D]` a one-layer perceptron gives `pre [T, N]` (collapse weights),
    `post [T, N]` (expand weights) and `comb [T, N, N]` (stream mixing), the latter projected
    onto doubly-stochastic matrices by Sinkhorn-Knopp iterations. All of it runs in fp32.
    """

    def __init__(self, hc_mult: int, hidden: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        n = hc_mult
        self.n, self.iters, self.hc_eps, self.norm_eps = n, sinkhorn_iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams `[T, N, D]` -> (post `[T, N]`, comb `[T, N, N]`, block input `[T, D]`)."""
        n, eps = self.n, self.hc_eps
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mix = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        # in place: on [T, N, N] matrices the cost is per-op overhead, not arithmetic
        for _ in range(self.iters - 1):
            comb.div_(comb.sum(dim=-1, keepdim=True).add_(eps))
            comb.div_(comb.sum(dim=-2, keepdim=True).add_(eps))
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """New streams `[T, N, D]` = post ⊗ block output + combᵀ · old streams."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """Final collapse of the N streams `[T, N, D]` into one hidden state `[T, D]`."""

    def __init__(self, hc_mult: int, hidden: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc_mult, hc_mult * hidden, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
