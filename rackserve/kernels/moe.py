"""Routed-expert FFN over tokens grouped by expert: gate_up GEMM, clamped SwiGLU, down GEMM,
weighted by each token's routing weight and summed back per token.

Shapes: T tokens, D hidden, E experts, I expert intermediate size, k experts per token.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU: silu(min(gate, limit)) · clamp(up, ±limit)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids `[T, k]` -> (order `[T·k]`: (token, slot) pairs sorted by expert, stable;
    counts `[E]`: pairs per expert). Pair p is token p // k, slot p % k."""
    flat = ids.flatten()
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_experts)


def moe_ffn_torch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, limit: float) -> torch.Tensor:
    """x `[T, D]`, ids/weights `[T, k]`, gate_up `[E, 2I, D]`, down `[E, D, I]` -> `[T, D]`
    = Σ_k weight · down_e(swiglu(gate_up_e · x))."""
    order, counts = group_by_expert(ids, gate_up.shape[0])
    token = order // ids.shape[1]
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    h = torch._grouped_mm(x[token], gate_up.transpose(1, 2), offs=offsets)
    gate, up = h.chunk(2, dim=-1)
    out = torch._grouped_mm(swiglu(gate, up, limit), down.transpose(1, 2), offs=offsets)
    out = out * weights.flatten()[order, None].to(out.dtype)
    return torch.zeros_like(x).index_add_(0, token, out)


# --- Triton ----------------------------------------------------------------------------------------
#
# Two grouped GEMMs over the (token, slot) pairs sorted by expert. The host cuts each expert's
# segment into BLOCK_M-row tiles and writes one small table (expert, first row, segment end per
# tile); program (tile, n) computes one BLOCK_M × BLOCK_N output block of one expert. The table
# has a fixed length, an upper bound on the tile count, so building it never syncs with the
# device; the unused tail has empty row ranges and its programs return at once.
# fp32 operands use input_precision="ieee": on a GPU tl.dot would otherwise round them to TF32.
# UPCAST (set under the Triton interpreter only) feeds tl.dot fp32 copies of 16-bit operands: the
# interpreter of triton 3.9 multiplies bf16 as their raw uint16 bits. The upcast is exact (a bf16
# product fits in fp32), so the interpreter still checks the same arithmetic as the GPU path.


@triton.jit
def _tile(sched_ptr, num_tiles, BLOCK_M: tl.constexpr):
    """This program's tile of the schedule: (expert, or -1 for an unused tile; its rows [BLOCK_M]
    into the expert-sorted pairs; which of them are real)."""
    tile = tl.program_id(0)
    row_start = tl.load(sched_ptr + num_tiles + tile)
    row_end = tl.load(sched_ptr + 2 * num_tiles + tile)
    expert = tl.where(row_start < row_end, tl.load(sched_ptr + tile).to(tl.int64), -1)
    rows = row_start + tl.arange(0, BLOCK_M)
    return expert, rows, rows < row_end


@triton.jit
def _gate_up_swiglu_kernel(x_ptr, w_ptr, h_ptr, token_ptr, sched_ptr, num_tiles, D, I, limit,
                           stride_xt, stride_xd, stride_we, stride_wn, stride_wd, stride_ht, stride_hi,
                           PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """h[rows, n-block] = swiglu(x[token[rows]] · gate_e^T, x[token[rows]] · up_e^T)."""
    expert, rows, mask_m = _tile(sched_ptr, num_tiles, BLOCK_M)
    if expert < 0:
        return
    tokens = tl.load(token_ptr + rows, mask=mask_m, other=0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xd
    # gate rows are gate_up[e, :I], up rows gate_up[e, I:]; both read as [BLOCK_K, BLOCK_N]
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wd
    u_ptrs = g_ptrs + I * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        mask_k = offs_k < D - k0
        a = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w_mask = mask_k[:, None] & mask_n[None, :]
        g = tl.load(g_ptrs, mask=w_mask, other=0.0)
        u = tl.load(u_ptrs, mask=w_mask, other=0.0)
        if UPCAST:
            a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xd
        g_ptrs += BLOCK_K * stride_wd
        u_ptrs += BLOCK_K * stride_wd

    gate = tl.minimum(acc_g, limit)
    up = tl.minimum(tl.maximum(acc_u, -limit), limit)
    h = gate * tl.sigmoid(gate) * up
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_ht + offs_n[None, :] * stride_hi
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, out_ptr, pair_ptr, weight_ptr, sched_ptr, num_tiles, D, I,
                 stride_ht, stride_hi, stride_we, stride_wd, stride_wi, stride_ot, stride_od,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[pair[rows], n-block] = weight[pair[rows]] · (h[rows] · down_e^T), one row per pair."""
    expert, rows, mask_m = _tile(sched_ptr, num_tiles, BLOCK_M)
    if expert < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < D
    offs_k = tl.arange(0, BLOCK_K)

    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_ht + offs_k[None, :] * stride_hi
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wd + offs_k[:, None] * stride_wi
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        mask_k = offs_k < I - k0
        a = tl.load(h_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        h_ptrs += BLOCK_K * stride_hi
        w_ptrs += BLOCK_K * stride_wi

    pairs = tl.load(pair_ptr + rows, mask=mask_m, other=0).to(tl.int64)
    acc *= tl.load(weight_ptr + pairs, mask=mask_m, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pairs[:, None] * stride_ot + offs_n[None, :] * stride_od
    tl.store(out_ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])


def _block(size: int, most: int) -> int:
    """A power-of-two tile edge covering `size`, at least 16 (tl.dot's minimum) and at most `most`."""
    return min(most, max(16, triton.next_power_of_2(size)))


def tile_schedule(counts: torch.Tensor, block_m: int, max_tiles: int) -> torch.Tensor:
    """counts `[E]` pairs per expert -> `[3, max_tiles]` int32: per tile its expert, first row
    and segment end, in rows of the expert-sorted pairs. Tiles past the real count have
    first row = end = 0. `max_tiles` must be ≥ Σ ceil(counts / block_m)."""
    num_experts = counts.shape[0]
    tiles = (counts + block_m - 1) // block_m
    tiles_end = torch.cumsum(tiles, 0)
    seg_end = torch.cumsum(counts, 0)
    tile = torch.arange(max_tiles, device=counts.device)
    expert = torch.searchsorted(tiles_end, tile, right=True)  # experts without tiles are skipped
    real = expert < num_experts
    expert = expert.clamp(max=num_experts - 1)
    first_row = seg_end[expert] - counts[expert] + (tile - (tiles_end - tiles)[expert]) * block_m
    zero = torch.zeros_like(first_row)
    return torch.stack([expert, torch.where(real, first_row, zero),
                        torch.where(real, seg_end[expert], zero)]).to(torch.int32)


def moe_ffn_triton(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, limit: float) -> torch.Tensor:
    """`moe_ffn_torch` as two grouped-GEMM Triton kernels; same shapes and dtype.

    Accumulates in fp32 (also across the k experts of a token, then casts once), and writes each
    (token, slot) row once before a sum over k: no atomics, so results are bit-reproducible.
    """
    num_tokens, k = ids.shape
    num_experts, two_i, hidden = gate_up.shape
    inter = two_i // 2
    if not x.dtype == gate_up.dtype == down.dtype:
        raise ValueError(f"moe_ffn_triton needs one dtype for x, gate_up and down; got {x.dtype}, "
                         f"{gate_up.dtype}, {down.dtype}: cast the activations to the weights' dtype")
    pairs = num_tokens * k
    if pairs == 0:
        return torch.zeros_like(x)
    order, counts = group_by_expert(ids, num_experts)
    token = (order // k).to(torch.int32)
    # small segments (decode) want 16-row tiles, long ones (prefill) 64
    block_m = _block(pairs // min(num_experts, pairs), 64)
    max_tiles = triton.cdiv(pairs, block_m) + min(num_experts, pairs)
    sched = tile_schedule(counts, block_m, max_tiles)
    upcast = os.environ.get("TRITON_INTERPRET") == "1"
    precision = "ieee" if upcast or x.dtype == torch.float32 else "tf32"  # only fp32 operands read it

    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    block_n, block_k = _block(inter, 64), _block(hidden, 64)
    _gate_up_swiglu_kernel[(max_tiles, triton.cdiv(inter, block_n))](
        x, gate_up, h, token, sched, max_tiles, hidden, inter, float(limit),
        x.stride(0), x.stride(1), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2), h.stride(0), h.stride(1),
        PRECISION=precision, UPCAST=upcast, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)

    out = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    block_n, block_k = _block(hidden, 128), _block(inter, 64)
    _down_kernel[(max_tiles, triton.cdiv(hidden, block_n))](
        h, down, out, order.to(torch.int32), weights.reshape(-1), sched, max_tiles, hidden, inter,
        h.stride(0), h.stride(1), down.stride(0), down.stride(1), down.stride(2), out.stride(0), out.stride(1),
        PRECISION=precision, UPCAST=upcast, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out.view(num_tokens, k, hidden).sum(1).to(x.dtype)
