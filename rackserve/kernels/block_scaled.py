"""Weights stored as published: FP8 e4m3 with one scale per block, FP4 e2m1 with one scale per 32 inputs.

A quantized weight is a pair (codes, scales) kept as the checkpoint stores it:
- FP8: codes `torch.float8_e4m3fn` `[.., N, K]`, scales `[.., N / bn, K / bk]` (DeepSeek: 128 × 128 blocks);
- FP4: codes int8 `[.., N, K / 2]`, two e2m1 values a byte (element 2i in the low nibble, code = sign·8 +
  magnitude index, as `rackserve.kernels.quant`), scales `[.., N, K / 32]`.
Scales are fp32, or UE8M0 (`torch.float8_e8m0fnu`: a power of two 2^(byte - 127)), one byte each. The block
is what the grid implies (N / scale rows, K / scale columns), as in the reference loader, so a checkpoint
may mix 128 × 128 FP8 blocks and 1 × 32 FP4 groups.

value = code · scale, computed in fp32 and cast once to the compute dtype: bit for bit what
`transformers`' `Fp8Dequantize` gives. The torch references below dequantize what they use and run the
same matmul as the unquantized model; the Triton kernels decode weight tiles in registers instead (the
same value, cast to the activations' dtype) and accumulate in fp32.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rackserve.kernels.moe import (WEIGHTS_FP4, WEIGHTS_FP8, GemmWeights, dot_settings, grouped_moe_ffn, moe_ffn_torch,
                                   tile_edge, weight_gemm)
from rackserve.kernels.quant import E2M1, FP4_MAX, FP8_MAX, encode_fp4
from rackserve.kernels.triton_utils import emulate_rne_bf16, round_to_bf16

FP8 = torch.float8_e4m3fn
UE8M0 = torch.float8_e8m0fnu
FP4_GROUP = 32  # inputs per FP4 scale


class ScaleGridError(ValueError):
    """A scale grid that does not tile its weight; the message names the shapes."""


def is_fp4(codes: torch.Tensor) -> bool:
    """Whether `codes` hold packed FP4 (int8, two values a byte) rather than FP8."""
    return codes.dtype in (torch.int8, torch.uint8)


def logical_shape(codes: torch.Tensor) -> tuple[int, ...]:
    """The shape of the weight `codes` stand for (FP4: twice the stored last dim)."""
    return (*codes.shape[:-1], codes.shape[-1] * 2) if is_fp4(codes) else tuple(codes.shape)


def block_of(codes: torch.Tensor, scales: torch.Tensor) -> tuple[int, int]:
    """(rows, inputs) of weight per scale, from the two grids; raises `ScaleGridError` if they do not tile."""
    *lead, n, k = logical_shape(codes)
    if scales.dim() != len(lead) + 2 or list(scales.shape[:-2]) != lead:
        raise ScaleGridError(f"scales {list(scales.shape)} do not match weight {[*lead, n, k]}: "
                             "want one [rows, columns] grid per matrix")
    sn, sk = scales.shape[-2:]
    if sn == 0 or sk == 0 or n % sn or k % sk:
        raise ScaleGridError(f"a scale grid of {sn} × {sk} does not divide weight {n} × {k} into equal blocks")
    return n // sn, k // sk


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """Scales as fp32: UE8M0 bytes b -> 2^(b - 127), fp32 as they are."""
    if scales.dtype == UE8M0:
        exponent = scales.view(torch.uint8).int() - 127
        return torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent)
    return scales.float()


@functools.cache
def _fp4_pairs(device: torch.device) -> torch.Tensor:
    """`[256, 2]` fp32: the two e2m1 values of every byte, low nibble first."""
    lut = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32)
    byte = torch.arange(256)
    return torch.stack([lut[byte & 0xF], lut[byte >> 4]], dim=1).to(device)


def code_values(codes: torch.Tensor) -> torch.Tensor:
    """codes -> their fp32 values, `logical_shape(codes)` (FP4 unpacked by one table lookup a byte)."""
    if is_fp4(codes):
        pairs = _fp4_pairs(codes.device)[codes.view(torch.uint8).long()]
        return pairs.flatten(-2)
    return codes.float()


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(codes, scales) -> the weight `logical_shape(codes)` in `dtype` (multiplied in fp32)."""
    bn, bk = block_of(codes, scales)
    values = code_values(codes)
    *lead, n, k = values.shape
    s = scale_values(scales)
    grid = values.reshape(*lead, n // bn, bn, k // bk, bk) * s.reshape(*lead, n // bn, 1, k // bk, 1)
    return grid.reshape(values.shape).to(dtype)


def fp8_linear_torch(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x `[T, K]` · Wᵀ for W = dequantize(codes `[N, K]`, scales) -> `[T, N]` in x's dtype. Grouped
    (V4's output projection): x `[T, G, K]`, codes for `[G, N, K]` -> `[T, G, N]`, group g by W[g]."""
    w = dequantize(codes, scales, x.dtype)
    return F.linear(x, w) if w.dim() == 2 else torch.einsum("tgk,gnk->tgn", x, w)


def moe_ffn_quantized_torch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                            gate_up: torch.Tensor, gate_up_scales: torch.Tensor,
                            down: torch.Tensor, down_scales: torch.Tensor, limit: float) -> torch.Tensor:
    """`moe_ffn_torch` over quantized experts: gate_up codes for `[E, 2I, D]`, down codes for `[E, D, I]`,
    with their scale grids -> `[T, D]`. Dequantizes only the experts the batch routes to."""
    used, local = torch.unique(ids, return_inverse=True)
    gate_up_w = dequantize(gate_up[used], gate_up_scales[used], x.dtype)
    down_w = dequantize(down[used], down_scales[used], x.dtype)
    return moe_ffn_torch(x, local.view_as(ids), weights, gate_up_w, down_w, limit)


# --- Triton ------------------------------------------------------------------------------------------
# The weight tiles are read and decoded by `moe.weight_gemm` (`weight_dot`), shared with the grouped MoE GEMMs.


def gemm_weights(codes: torch.Tensor, scales: torch.Tensor) -> GemmWeights:
    """(codes, scales) as the Triton kernels read them (UE8M0 as its exponent bytes); checks the grid."""
    block = block_of(codes, scales)
    fmt = WEIGHTS_FP4 if is_fp4(codes) else WEIGHTS_FP8
    return GemmWeights(codes, scales.view(torch.uint8) if scales.dtype == UE8M0 else scales.float(), block, fmt.value)


@triton.jit
def _linear_kernel(x_ptr, out_ptr, T, N, K, w_ptr, s_ptr, bn, bk, stride_wg, stride_wn, stride_wk,
                   stride_sg, stride_sn, stride_sk, stride_xt, stride_xg, stride_xk, stride_ot, stride_og, stride_on,
                   FORMAT: tl.constexpr, ONE_K_BLOCK: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                   RNE_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[m-block, g, n-block] = x[m-block, g] · W[g, n-block]ᵀ, W block-scaled codes decoded tile by
    tile; group g = program 2 (one group, strides 0, for a plain linear)."""
    group = tl.program_id(2).to(tl.int64)
    x_ptr += group * stride_xg
    out_ptr += group * stride_og
    w_ptr += group * stride_wg
    s_ptr += group * stride_sg
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < T, offs_n < N
    acc = weight_gemm(x_ptr, offs_m, mask_m, stride_xt, stride_xk, K, w_ptr, s_ptr, offs_n, mask_n, bn, bk, stride_wn,
                      stride_wk, stride_sn, stride_sk, FORMAT, ONE_K_BLOCK, PRECISION, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
    if RNE_BF16:  # interpreter only: its fp32 -> bf16 cast truncates, a GPU's rounds to nearest even
        acc = round_to_bf16(acc)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_ot + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def fp8_linear_triton(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`fp8_linear_torch` as a Triton kernel: x `[T, K]` fp32 / bf16 / fp16, codes `[N, K]` (FP8, or
    packed FP4 `[N, K / 2]`) with their scale grid -> `[T, N]` in x's dtype, accumulated in fp32; grouped,
    x `[T, G, K]` and codes for `[G, N, K]` -> `[T, G, N]`, one launch for all groups."""
    w = gemm_weights(codes, scales)
    *groups, n, k = logical_shape(codes)
    if x.shape[-1] != k or (groups and (x.dim() != 3 or x.shape[1] != groups[0])):
        want = f"[T, {groups[0]}, {k}]" if groups else f"[T, {k}]"
        raise ValueError(f"x {list(x.shape)} does not fit a weight of {[*groups, n, k]}: want x {want}")
    x3 = x if groups else x.reshape(-1, 1, k)  # [T, G, K]
    out = torch.empty(x3.shape[0], x3.shape[1], n, dtype=x.dtype, device=x.device)
    if out.numel():
        precision, upcast = dot_settings(x.dtype)
        t = x3.shape[0]
        block_m, block_n, (block_k, one_k_block) = tile_edge(t, 64), tile_edge(n, 64), w.k_tile(k, 64)
        strides = w.args()[4:] if groups else (0, *w.args()[4:6], 0, *w.args()[6:])  # plain: group strides 0
        _linear_kernel[(triton.cdiv(t, block_m), triton.cdiv(n, block_n), x3.shape[1])](
            x3, out, t, n, k, *w.args()[:4], *strides, *x3.stride(), *out.stride(),
            FORMAT=w.fmt, ONE_K_BLOCK=one_k_block, PRECISION=precision, UPCAST=upcast, RNE_BF16=emulate_rne_bf16(out),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out if groups else out.view(*x.shape[:-1], n)


def moe_ffn_quantized_triton(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                             gate_up: torch.Tensor, gate_up_scales: torch.Tensor,
                             down: torch.Tensor, down_scales: torch.Tensor, limit: float) -> torch.Tensor:
    """`moe_ffn_quantized_torch` as the grouped-GEMM kernels of `moe_ffn_triton`, decoding each expert
    tile in registers (FP8 or FP4, each of gate_up and down on its own) -> `[T, D]` in x's dtype."""
    num_experts, two_i, hidden = logical_shape(gate_up)
    if logical_shape(down) != (num_experts, hidden, two_i // 2) or x.shape[-1] != hidden:
        raise ValueError(f"experts gate_up {[num_experts, two_i, hidden]} and down {list(logical_shape(down))} "
                         f"do not fit x {list(x.shape)}: want [E, 2I, D] and [E, D, I] for x [T, D]")
    return grouped_moe_ffn(x, ids, weights, gemm_weights(gate_up, gate_up_scales),
                           gemm_weights(down, down_scales), limit)


# --- writing quantized weights (checkpoints in the published layout) ----------------------------------


def quantize(w: torch.Tensor, block: tuple[int, int], fp4: bool = False,
             ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight `[.., N, K]` -> (codes, scales) as a published checkpoint stores it.

    FP8: one scale per `block` (rows, inputs), amax / 448; FP4: one per 32 inputs of a row, amax / 6
    (`block` unused). `ue8m0` rounds each scale up to a power of two (so no value overflows) and stores
    its exponent byte. Rounding to the nearest code, ties to even (FP4 by `quant`'s rule).
    """
    *lead, n, k = w.shape
    bn, bk = (1, FP4_GROUP) if fp4 else block
    if n % bn or k % bk:
        raise ScaleGridError(f"weight {n} × {k} is not a whole number of {bn} × {bk} blocks")
    grid = w.float().reshape(*lead, n // bn, bn, k // bk, bk)
    amax = grid.abs().amax(dim=(-3, -1))
    scales = amax / (FP4_MAX if fp4 else FP8_MAX)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    if ue8m0:
        mantissa, exponent = torch.frexp(scales)  # scales = m · 2^e, m in [0.5, 1): 2^e ≥ scales
        scales = torch.ldexp(torch.ones_like(scales), exponent - (mantissa == 0.5).int())
    y = grid / scales.reshape(*lead, n // bn, 1, k // bk, 1)
    if fp4:
        codes = encode_fp4(y.reshape(-1, k)).view(torch.int8).reshape(*lead, n, k // 2)
    else:
        codes = y.clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(*lead, n, k)
    return codes, scales.to(UE8M0) if ue8m0 else scales
