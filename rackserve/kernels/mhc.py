"""mHC (manifold-constrained hyper-connections): the per-token weights of the residual streams.

Shapes: T tokens, N = hc_mult streams, D hidden. Everything runs in fp32; `collapsed` and the
merged streams come back in the streams' dtype. The torch functions are the reference the Triton
kernels are checked against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm without a weight over the last axis."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def mhc_pre_torch(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                  sinkhorn_iters: int, hc_eps: float, norm_eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights of one mHC and the block input.

    streams `[T, N, D]`; fn `[(2+N)·N, N·D]`; base `[(2+N)·N]`; scale `[3]` ->
    post `[T, N]`, comb `[T, N, N]` (doubly stochastic after `sinkhorn_iters` Sinkhorn-Knopp
    iterations), collapsed `[T, D]` = Σ_n pre_n · streams_n.
    """
    n = streams.shape[1]
    flat = unweighted_rms_norm(streams.flatten(1).float(), norm_eps)
    mix = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre_s, post_s, comb_s = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    # in place: on [T, N, N] matrices the cost is per-op overhead, not arithmetic
    for _ in range(sinkhorn_iters - 1):
        comb.div_(comb.sum(dim=-1, keepdim=True).add_(hc_eps))
        comb.div_(comb.sum(dim=-2, keepdim=True).add_(hc_eps))
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def mhc_post_torch(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams `[T, N, D]` = post_n · out + Σ_m comb[m, n] · streams_m (out `[T, D]`)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


def mhc_head_torch(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                   hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Final collapse of the streams `[T, N, D]` -> `[T, D]`; fn `[N, N·D]`, base `[N]`, scale `[1]`."""
    flat = unweighted_rms_norm(streams.flatten(1).float(), norm_eps)
    pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
