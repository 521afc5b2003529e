"""Routed-expert FFN over tokens grouped by expert: gate_up GEMM, clamped SwiGLU, down GEMM,
weighted by each token's routing weight and summed back per token.

Shapes: T tokens, D hidden, E experts, I expert intermediate size, k experts per token.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rackserve.kernels.triton_utils import round_to_bf16


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
#
# The expert weights are plain (the activations' dtype) or block-scaled as published checkpoints
# store them (`rackserve.kernels.block_scaled`): FP8 e4m3 or packed FP4 e2m1 codes with a grid of
# fp32 or UE8M0 scales. A quantized tile is decoded in registers, value = code · scale in fp32, and
# cast once to the activations' dtype, which is what `block_scaled.dequantize` computes.

# weight formats (constexpr: kernels may read only constexpr globals)
WEIGHTS_PLAIN, WEIGHTS_FP8, WEIGHTS_FP4 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


class GemmWeights(NamedTuple):
    """Weights `[.., N, K]` as the kernels read them: `data` plain, or codes with a scale grid.

    data: plain in the activations' dtype; FP8: float8_e4m3fn codes `[.., N, K]`; FP4: int8 codes
    `[.., N, K / 2]` (element 2i in the low nibble). scales: `[.., N / bn, K / bk]` fp32, or uint8
    UE8M0 exponents (2^(byte - 127)); plain weights pass `data` again, never read.
    """
    data: torch.Tensor
    scales: torch.Tensor
    block: tuple[int, int]  # (bn, bk): rows and inputs per scale
    fmt: int

    @classmethod
    def plain(cls, w: torch.Tensor) -> GemmWeights:
        return cls(w, w, (1, 1), WEIGHTS_PLAIN.value)

    def args(self) -> tuple:
        """The kernels' weight arguments: pointers, block, then the data's and the scales' strides."""
        return (self.data, self.scales, *self.block, *self.data.stride(), *self.scales.stride())

    def k_tile(self, size: int, most: int) -> tuple[int, bool]:
        """(BLOCK_K for `size` inputs, whether every K tile lies inside one scale column). Tiles of a
        power of two dividing bk (at least 16, tl.dot's minimum) do, and then read one scale per row."""
        block = tile_edge(size, most)
        fit = self.block[1] & -self.block[1]  # the largest power of two dividing bk
        if self.fmt == WEIGHTS_PLAIN.value or fit < 16:
            return block, False
        return min(block, fit), True


@triton.jit
def _decode(w, cols, FORMAT: tl.constexpr):
    """Loaded codes `[BLOCK_K, BLOCK_N]` of inputs `cols` -> their fp32 values (FP4: the byte of two
    inputs was loaded for each; odd inputs take its high nibble)."""
    # one return at the end: a compiled kernel still traces the code after an early return (here an
    # fp8 -> int cast it rejects), the interpreter does not
    if FORMAT == WEIGHTS_FP8:
        # the interpreter reads the NaN codes 0x7F / 0xFF as ±480 (a GPU as NaN); checkpoints hold none
        values = w.to(tl.float32)
    else:
        code = (w.to(tl.int32) >> ((cols % 2) * 4)[:, None]) & 0xF
        exp = (code >> 1) & 0x3
        man = (code & 1).to(tl.float32)
        # e2m1: exponent 0 is subnormal (man · 0.5), else (2 + man) · 2^(exp - 2)
        mag = tl.where(exp == 0, man * 0.5, (2.0 + man) * (1 << exp).to(tl.float32) * 0.25)
        values = tl.where(code >= 8, -mag, mag)
    return values


@triton.jit
def _scale(s_ptr, rows, cols, k0, mask, mask_n, bn, bk, stride_sn, stride_sk, ONE_K_BLOCK: tl.constexpr):
    """The fp32 scales of weight tile (cols, rows): `[1, BLOCK_N]` when the tile lies in one scale
    column (the usual case, one load a row), else one per element `[BLOCK_K, BLOCK_N]`."""
    if ONE_K_BLOCK:
        s = tl.load(s_ptr + (rows // bn) * stride_sn + (k0 // bk) * stride_sk, mask=mask_n, other=0)[None, :]
    else:
        s = tl.load(s_ptr + (rows // bn)[None, :] * stride_sn + (cols // bk)[:, None] * stride_sk, mask=mask, other=0)
    if s_ptr.dtype.element_ty == tl.uint8:
        # UE8M0 2^(b - 127) as fp32 bits: the exponent field b, or for b = 0 the subnormal 2^-127
        s = tl.where(s == 0, 0x400000, s.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return s


@triton.jit
def weight_dot(acc, a, w_ptr, s_ptr, rows, k0, offs_k, mask_n, mask_k, bn, bk, stride_wn, stride_wk,
               stride_sn, stride_sk, FORMAT: tl.constexpr, ONE_K_BLOCK: tl.constexpr,
               PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc `[BLOCK_M, BLOCK_N]` + a `[BLOCK_M, BLOCK_K]` · W[rows, k0 + offs_k]ᵀ, W read as
    `GemmWeights` of FORMAT."""
    cols = k0 + offs_k
    mask = mask_k[:, None] & mask_n[None, :]
    byte_cols = cols // 2 if FORMAT == WEIGHTS_FP4 else cols
    w = tl.load(w_ptr + rows[None, :] * stride_wn + byte_cols[:, None] * stride_wk, mask=mask, other=0.0)
    if FORMAT != WEIGHTS_PLAIN:
        w = _decode(w, cols, FORMAT) * _scale(s_ptr, rows, cols, k0, mask, mask_n, bn, bk, stride_sn, stride_sk,
                                              ONE_K_BLOCK)
        if UPCAST and a.dtype == tl.bfloat16:
            w = round_to_bf16(w)  # the interpreter's cast to bf16 truncates; a GPU's rounds to nearest
        else:
            w = w.to(a.dtype)
    if UPCAST:
        a, w = a.to(tl.float32), w.to(tl.float32)
    return tl.dot(a, w, acc, input_precision=PRECISION)


@triton.jit
def weight_gemm(a_ptr, rows, mask_m, stride_am, stride_ak, K, w_ptr, s_ptr, offs_n, mask_n, bn, bk, stride_wn,
                stride_wk, stride_sn, stride_sk, FORMAT: tl.constexpr, ONE_K_BLOCK: tl.constexpr,
                PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """A[rows, :K] · W[offs_n, :K]ᵀ `[BLOCK_M, BLOCK_N]` in fp32, K tile by K tile (`weight_dot`)."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        acc = weight_dot(acc, a, w_ptr, s_ptr, offs_n, k0, offs_k, mask_n, mask_k, bn, bk, stride_wn, stride_wk,
                         stride_sn, stride_sk, FORMAT, ONE_K_BLOCK, PRECISION, UPCAST)
        a_ptrs += BLOCK_K * stride_ak
    return acc


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
def _gate_up_swiglu_kernel(x_ptr, h_ptr, token_ptr, sched_ptr, num_tiles, D, I, limit,
                           w_ptr, s_ptr, bn, bk, stride_we, stride_wn, stride_wd, stride_se, stride_sn, stride_sd,
                           stride_xt, stride_xd, stride_ht, stride_hi,
                           FORMAT: tl.constexpr, ONE_K_BLOCK: tl.constexpr, PRECISION: tl.constexpr,
                           UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """h[rows, n-block] = swiglu(x[token[rows]] · gate_e^T, x[token[rows]] · up_e^T)."""
    expert, rows, mask_m = _tile(sched_ptr, num_tiles, BLOCK_M)
    if expert < 0:
        return
    tokens = tl.load(token_ptr + rows, mask=mask_m, other=0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    w_ptr += expert * stride_we
    s_ptr += expert * stride_se

    x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xd
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        mask_k = offs_k < D - k0
        a = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        # gate rows are gate_up[e, :I], up rows gate_up[e, I:]
        acc_g = weight_dot(acc_g, a, w_ptr, s_ptr, offs_n, k0, offs_k, mask_n, mask_k, bn, bk, stride_wn,
                           stride_wd, stride_sn, stride_sd, FORMAT, ONE_K_BLOCK, PRECISION, UPCAST)
        acc_u = weight_dot(acc_u, a, w_ptr, s_ptr, offs_n + I, k0, offs_k, mask_n, mask_k, bn, bk, stride_wn,
                           stride_wd, stride_sn, stride_sd, FORMAT, ONE_K_BLOCK, PRECISION, UPCAST)
        x_ptrs += BLOCK_K * stride_xd

    gate = tl.minimum(acc_g, limit)
    up = tl.minimum(tl.maximum(acc_u, -limit), limit)
    h = gate * tl.sigmoid(gate) * up
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_ht + offs_n[None, :] * stride_hi
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _down_kernel(h_ptr, out_ptr, pair_ptr, weight_ptr, sched_ptr, num_tiles, D, I,
                 w_ptr, s_ptr, bn, bk, stride_we, stride_wd, stride_wi, stride_se, stride_sd, stride_si,
                 stride_ht, stride_hi, stride_ot, stride_od,
                 FORMAT: tl.constexpr, ONE_K_BLOCK: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[pair[rows], n-block] = weight[pair[rows]] · (h[rows] · down_e^T), one row per pair."""
    expert, rows, mask_m = _tile(sched_ptr, num_tiles, BLOCK_M)
    if expert < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < D
    acc = weight_gemm(h_ptr, rows, mask_m, stride_ht, stride_hi, I, w_ptr + expert * stride_we,
                      s_ptr + expert * stride_se, offs_n, mask_n, bn, bk, stride_wd, stride_wi, stride_sd, stride_si,
                      FORMAT, ONE_K_BLOCK, PRECISION, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
    pairs = tl.load(pair_ptr + rows, mask=mask_m, other=0).to(tl.int64)
    acc *= tl.load(weight_ptr + pairs, mask=mask_m, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pairs[:, None] * stride_ot + offs_n[None, :] * stride_od
    tl.store(out_ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])


def dot_settings(dtype: torch.dtype) -> tuple[str, bool]:
    """(PRECISION, UPCAST) for activations of `dtype`: see the notes above the kernels."""
    upcast = os.environ.get("TRITON_INTERPRET") == "1"
    return "ieee" if upcast or dtype == torch.float32 else "tf32", upcast  # only fp32 operands read it


def tile_edge(size: int, most: int) -> int:
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
    if not x.dtype == gate_up.dtype == down.dtype:
        raise ValueError(f"moe_ffn_triton needs one dtype for x, gate_up and down; got {x.dtype}, "
                         f"{gate_up.dtype}, {down.dtype}: cast the activations to the weights' dtype")
    return grouped_moe_ffn(x, ids, weights, GemmWeights.plain(gate_up), GemmWeights.plain(down), limit)


def grouped_moe_ffn(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: GemmWeights,
                    down: GemmWeights, limit: float) -> torch.Tensor:
    """`moe_ffn_triton` over experts in any `GemmWeights` format: gate_up for `[E, 2I, D]`, down for
    `[E, D, I]` (sizes as the codes stand for them) -> `[T, D]` in x's dtype."""
    num_tokens, k = ids.shape
    num_experts, two_i = gate_up.data.shape[:2]
    hidden, inter = x.shape[1], two_i // 2
    pairs = num_tokens * k
    if pairs == 0:
        return torch.zeros_like(x)
    order, counts = group_by_expert(ids, num_experts)
    token = (order // k).to(torch.int32)
    # small segments (decode) want 16-row tiles, long ones (prefill) 64
    block_m = tile_edge(pairs // min(num_experts, pairs), 64)
    max_tiles = triton.cdiv(pairs, block_m) + min(num_experts, pairs)
    sched = tile_schedule(counts, block_m, max_tiles)
    precision, upcast = dot_settings(x.dtype)

    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    block_n, (block_k, one_k_block) = tile_edge(inter, 64), gate_up.k_tile(hidden, 64)
    _gate_up_swiglu_kernel[(max_tiles, triton.cdiv(inter, block_n))](
        x, h, token, sched, max_tiles, hidden, inter, float(limit), *gate_up.args(),
        x.stride(0), x.stride(1), h.stride(0), h.stride(1), FORMAT=gate_up.fmt, ONE_K_BLOCK=one_k_block,
        PRECISION=precision, UPCAST=upcast, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)

    out = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    block_n, (block_k, one_k_block) = tile_edge(hidden, 128), down.k_tile(inter, 64)
    _down_kernel[(max_tiles, triton.cdiv(hidden, block_n))](
        h, out, order.to(torch.int32), weights.reshape(-1), sched, max_tiles, hidden, inter, *down.args(),
        h.stride(0), h.stride(1), out.stride(0), out.stride(1), FORMAT=down.fmt, ONE_K_BLOCK=one_k_block,
        PRECISION=precision, UPCAST=upcast, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out.view(num_tokens, k, hidden).sum(1).to(x.dtype)
