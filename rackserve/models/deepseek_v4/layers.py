"""Small building blocks of DeepSeek-V4: RMS norms and the mHC residual streams.

Shapes: T = tokens in the ragged batch, N = `hc_mult` residual streams, D = hidden size.
"""

from __future__ import annotations

import torch
from torch import nn

from rackserve.kernels import dispatch
from rackserve.kernels.mhc import collapse


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
        return dispatch.mhc_pre(streams, self.fn, self.base, self.scale, self.iters, self.hc_eps, self.norm_eps)

    def mixes(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams `[T, N, D]` -> (pre `[T, N]`, post `[T, N]`, comb `[T, N, N]`), without collapsing:
        a delayed mHC (DeepSeek-V4.1) collapses the *next* block's input with this `pre`."""
        return dispatch.mhc_mix(streams, self.fn, self.base, self.scale, self.iters, self.hc_eps, self.norm_eps)

    @staticmethod
    def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """Block input `[T, D]` = Σ_n pre_n · streams_n (streams `[T, N, D]`, pre `[T, N]`)."""
        return collapse(streams, pre)

    @staticmethod
    def merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """New streams `[T, N, D]` = post ⊗ block output + combᵀ · old streams."""
        return dispatch.mhc_post(streams, out, post, comb)


class HyperHead(nn.Module):
    """Final collapse of the N streams `[T, N, D]` into one hidden state `[T, D]`."""

    def __init__(self, hc_mult: int, hidden: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc_mult, hc_mult * hidden, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        return dispatch.mhc_head(streams, self.hc_fn, self.hc_base, self.hc_scale, self.hc_eps, self.norm_eps)
