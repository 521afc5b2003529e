"""mHC (manifold-constrained hyper-connections): the per-token weights of the residual streams.

Shapes: T tokens, N = hc_mult streams, D hidden. Everything runs in fp32; `collapsed` and the
merged streams come back in the streams' dtype. The torch functions are the reference the Triton
kernels are checked against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rackserve.kernels.triton_utils import emulate_rne_bf16, round_to_bf16


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm without a weight over the last axis."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def mhc_mix_torch(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                  sinkhorn_iters: int, hc_eps: float, norm_eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three weights of one mHC.

    streams `[T, N, D]`; fn `[(2+N)·N, N·D]`; base `[(2+N)·N]`; scale `[3]` -> pre `[T, N]` (collapse
    weights), post `[T, N]` (expand weights), comb `[T, N, N]` (doubly stochastic after
    `sinkhorn_iters` Sinkhorn-Knopp iterations), all fp32.
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
    return pre, post, comb


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Σ_n pre_n · streams_n: streams `[T, N, D]`, pre `[T, N]` (fp32) -> `[T, D]` in the streams' dtype."""
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def mhc_pre_torch(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                  sinkhorn_iters: int, hc_eps: float, norm_eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights of one mHC and the block input collapsed with its own pre weights (`mhc_mix_torch`):
    post `[T, N]`, comb `[T, N, N]`, collapsed `[T, D]` = Σ_n pre_n · streams_n."""
    pre, post, comb = mhc_mix_torch(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)
    return post, comb, collapse(streams, pre)


def mhc_post_torch(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams `[T, N, D]` = post_n · out + Σ_m comb[m, n] · streams_m (out `[T, D]`)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


def mhc_head_torch(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                   hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Final collapse of the streams `[T, N, D]` -> `[T, D]`; fn `[N, N·D]`, base `[N]`, scale `[1]`."""
    flat = unweighted_rms_norm(streams.flatten(1).float(), norm_eps)
    pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + hc_eps
    return collapse(streams, pre)


# ---------------------------------------------------------------------------------------------
# Triton

@triton.jit
def _mhc_weights_kernel(streams_ptr, fn_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, collapsed_ptr,
                        D, sinkhorn_iters, hc_eps, norm_eps,
                        N: tl.constexpr, COMB: tl.constexpr, COLLAPSE: tl.constexpr, RNE_BF16: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token: RMS norm of the flat streams, the (2+N)·N-row GEMV, the gates, Sinkhorn, the collapse.

    COMB False is `mhc_head`: only the N `pre` rows of `fn` exist, and post/comb are not written.
    COLLAPSE False is `mhc_mix`: `pre` is written instead of the collapse (a later block collapses with it).
    """
    t = tl.program_id(0).to(tl.int64)
    K = N * D
    x_row = streams_ptr + t * K
    n = tl.arange(0, N)
    # Accumulate elementwise and reduce once after the loop; rms(x) scales every dot product
    # alike, so the raw dots are scaled by 1/rms at the end instead of normalising x first.
    sumsq = tl.zeros([BLOCK_K], dtype=tl.float32)
    acc_pre = tl.zeros([N, BLOCK_K], dtype=tl.float32)
    acc_post = tl.zeros([N, BLOCK_K], dtype=tl.float32)
    acc_comb = tl.zeros([N, N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        mk = k < K
        x = tl.load(x_row + k, mask=mk, other=0.0).to(tl.float32)
        sumsq += x * x
        w = tl.load(fn_ptr + n[:, None] * K + k[None, :], mask=mk[None, :], other=0.0).to(tl.float32)
        acc_pre += w * x[None, :]
        if COMB:
            w = tl.load(fn_ptr + (N + n)[:, None] * K + k[None, :], mask=mk[None, :], other=0.0).to(tl.float32)
            acc_post += w * x[None, :]
            rows = 2 * N + n[:, None] * N + n[None, :]
            w3 = tl.load(fn_ptr + rows[:, :, None] * K + k[None, None, :], mask=mk[None, None, :],
                         other=0.0).to(tl.float32)
            acc_comb += w3 * x[None, None, :]
    rstd = 1.0 / tl.sqrt(tl.sum(sumsq, axis=0) / K + norm_eps)

    pre_logit = tl.sum(acc_pre, axis=1) * rstd * tl.load(scale_ptr).to(tl.float32)
    pre = tl.sigmoid(pre_logit + tl.load(base_ptr + n).to(tl.float32)) + hc_eps
    if COMB:
        post_logit = tl.sum(acc_post, axis=1) * rstd * tl.load(scale_ptr + 1).to(tl.float32)
        post = 2.0 * tl.sigmoid(post_logit + tl.load(base_ptr + N + n).to(tl.float32))
        tl.store(post_ptr + t * N + n, post)

        mn = n[:, None] * N + n[None, :]
        c = tl.sum(acc_comb, axis=2) * rstd * tl.load(scale_ptr + 2).to(tl.float32)
        c += tl.load(base_ptr + 2 * N + mn).to(tl.float32)
        c = tl.exp(c - tl.max(c, axis=1)[:, None])
        c = c / tl.sum(c, axis=1)[:, None] + hc_eps  # softmax over the last axis, as the reference
        c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
        for _ in range(sinkhorn_iters - 1):
            c = c / (tl.sum(c, axis=1)[:, None] + hc_eps)
            c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
        tl.store(comb_ptr + t * N * N + mn, c)
    if not COLLAPSE:
        tl.store(pre_ptr + t * N + n, pre)
        return

    # The collapse reads the token's streams a second time; at N·D ≤ 64 Ki elements they are
    # still in L2.
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        md = d < D
        x = tl.load(x_row + n[:, None] * D + d[None, :], mask=md[None, :], other=0.0).to(tl.float32)
        out = tl.sum(pre[:, None] * x, axis=0)
        if RNE_BF16:  # interpreter only: its fp32 -> bf16 cast truncates, a GPU's rounds to nearest even
            out = round_to_bf16(out)
        tl.store(collapsed_ptr + t * D + d, out.to(collapsed_ptr.dtype.element_ty), mask=md)


@triton.jit
def _mhc_post_kernel(streams_ptr, out_ptr, post_ptr, comb_ptr, new_ptr, D,
                     N: tl.constexpr, RNE_BF16: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token × BLOCK_D columns of new streams = post_n · out + Σ_m comb[m, n] · streams_m."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    md = d < D
    n = tl.arange(0, N)
    tile = t * N * D + n[:, None] * D + d[None, :]
    x = tl.load(streams_ptr + tile, mask=md[None, :], other=0.0).to(tl.float32)  # [m, d]
    out = tl.load(out_ptr + t * D + d, mask=md, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * N + n).to(tl.float32)
    comb = tl.load(comb_ptr + t * N * N + n[:, None] * N + n[None, :]).to(tl.float32)  # [m, n]
    new = post[:, None] * out[None, :] + tl.sum(comb[:, :, None] * x[:, None, :], axis=0)
    if RNE_BF16:  # interpreter only: its fp32 -> bf16 cast truncates, a GPU's rounds to nearest even
        new = round_to_bf16(new)
    tl.store(new_ptr + tile, new.to(new_ptr.dtype.element_ty), mask=md[None, :])


def _check_hc_mult(n: int) -> None:
    if n not in (1, 2, 4, 8):
        raise ValueError(f"the Triton mHC kernels need hc_mult (streams.shape[1]) in (1, 2, 4, 8), got {n}")


def _pow2_at_most(x: int) -> int:
    return 1 << (max(x, 1).bit_length() - 1)


def _weights(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, comb: bool, collapse: bool = True):
    """pre `[T, N]` (written when not `collapse`), post `[T, N]`, comb `[T, N, N]` (left unwritten when
    not `comb`), collapsed `[T, D]` (written when `collapse`).

    Every program reads all of fn ((2+N)·N·N·D fp32, 2.6 MiB at N=4, D=7168) from L2: right for
    decode batches; long prefills would want a block of tokens per program sharing each fn tile.
    """
    t, n, d = streams.shape
    _check_hc_mult(n)
    streams = streams.contiguous()
    pre = torch.empty(t, n, dtype=torch.float32, device=streams.device)
    post = torch.empty(t, n, dtype=torch.float32, device=streams.device)
    combs = torch.empty(t, n, n, dtype=torch.float32, device=streams.device)
    collapsed = torch.empty(t if collapse else 0, d, dtype=streams.dtype, device=streams.device)
    if t and d:
        # ~4 Ki fp32 of fn per step across all rows; (2+N)·N accumulators of BLOCK_K each.
        rows = (2 + n) * n if comb else n
        block_k = min(1024, max(16, _pow2_at_most(4096 // rows)), triton.next_power_of_2(n * d))
        block_d = min(triton.next_power_of_2(d), 4096 // n)
        _mhc_weights_kernel[(t,)](
            streams, fn.contiguous(), base.contiguous(), scale.contiguous(), pre, post, combs, collapsed,
            d, sinkhorn_iters, hc_eps, norm_eps, N=n, COMB=comb, COLLAPSE=collapse,
            RNE_BF16=emulate_rne_bf16(collapsed), BLOCK_K=block_k, BLOCK_D=block_d)
    return pre, post, combs, collapsed


def mhc_mix_triton(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                   sinkhorn_iters: int, hc_eps: float, norm_eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`mhc_mix_torch` as one Triton program per token; same shapes and dtypes."""
    return _weights(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, comb=True, collapse=False)[:3]


def mhc_pre_triton(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                   sinkhorn_iters: int, hc_eps: float, norm_eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`mhc_pre_torch` as one Triton program per token; same shapes and dtypes."""
    return _weights(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, comb=True)[1:]


def mhc_post_triton(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """`mhc_post_torch` as one Triton program per (token, BLOCK_D columns), in fp32."""
    t, n, d = streams.shape
    _check_hc_mult(n)
    new = torch.empty(t, n, d, dtype=torch.result_type(streams, out), device=streams.device)
    if t and d:
        block_d = min(triton.next_power_of_2(d), max(64, 4096 // (n * n)))
        _mhc_post_kernel[(t, triton.cdiv(d, block_d))](
            streams.contiguous(), out.contiguous(), post.contiguous(), comb.contiguous(), new, d,
            N=n, RNE_BF16=emulate_rne_bf16(new), BLOCK_D=block_d)
    return new


def mhc_head_triton(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                    hc_eps: float, norm_eps: float) -> torch.Tensor:
    """`mhc_head_torch` with the `mhc_pre` kernel, pre rows only."""
    return _weights(streams, fn, base, scale, 0, hc_eps, norm_eps, comb=False)[3]
