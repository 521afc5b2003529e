"""Compressor pooling: softmax-gated sums that turn windows of tokens into compressed entries.

Each entry pools K source rows `[kv | gate]`. Without overlap (HCA) the K = rate rows are one
window and C = d. With overlap (CSA) each row carries two series (C = 2d): the entry pools the
first series (Ca, channels :d) of the previous window's rate rows and the second series (Cb,
channels d:) of its own window's rate rows, K = 2·rate. The gate gets a learned per-slot bias
(DeepSeek-V4.1's compressors have none: `position_bias` None); invalid slots (the window before
entry 0) get zero weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rackserve.kernels.triton_utils import round_to_bf16, tl_dtype


def compress_pool_torch(src: torch.Tensor, valid: torch.Tensor, position_bias: torch.Tensor | None,
                        overlap: bool) -> torch.Tensor:
    """src `[N, K, 2C]` (`[kv | gate]` per slot), valid `[N, K]`, position_bias `[rate, C]` fp32 or None
    -> pooled `[N, d]` in src's dtype (d = C/2 with overlap, else C). Softmax in fp32."""
    kv, gate, bias = *src.chunk(2, dim=-1), position_bias
    if overlap:
        d, m = kv.shape[-1] // 2, src.shape[1] // 2
        kv = torch.cat([kv[:, :m, :d], kv[:, m:, d:]], dim=1)
        gate = torch.cat([gate[:, :m, :d], gate[:, m:, d:]], dim=1)
        bias = None if bias is None else torch.cat([bias[:, :d], bias[:, d:]])
    if bias is not None:
        gate = gate + bias
    gate = gate.masked_fill(~valid.unsqueeze(-1), float("-inf"))
    weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
    return (kv * weights).sum(dim=1)


@triton.jit
def _compress_pool_kernel(
        src_ptr, valid_ptr, bias_ptr, out_ptr, K, RATE, D, C,
        s_n, s_k, s_c, v_n, v_k, b_r, b_c, o_n, o_c,
        OVERLAP: tl.constexpr, OUT_DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr,
        BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    slot = tl.arange(0, BLOCK_K)
    mask_c, mask_k = offs_c < D, slot < K
    ok = (tl.load(valid_ptr + n * v_n + slot * v_k, mask=mask_k, other=0) != 0) & mask_k

    if OVERLAP:
        # slots [0, rate) pool series Ca (channels :D), slots [rate, 2·rate) series Cb (D:)
        second = slot >= RATE
        chan = offs_c[None, :] + tl.where(second, D, 0)[:, None]  # [BLOCK_K, BLOCK_C]
        bias_row = tl.where(second, slot - RATE, slot)
    else:
        chan = offs_c[None, :] + tl.zeros([BLOCK_K, 1], tl.int32)
        bias_row = slot
    mask = mask_k[:, None] & mask_c[None, :]
    base = src_ptr + n * s_n + slot[:, None] * s_k
    kv = tl.load(base + chan * s_c, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(base + (C + chan) * s_c, mask=mask, other=0.0).to(tl.float32)
    gate += tl.load(bias_ptr + bias_row[:, None] * b_r + chan * b_c, mask=mask, other=0.0)
    gate = tl.where(ok[:, None], gate, float("-inf"))

    e = tl.exp(gate - tl.max(gate, axis=0)[None, :])
    weight = e / tl.sum(e, axis=0)[None, :]
    # the reference rounds the weights and each product to src's dtype, then sums in fp32
    if ROUND_BF16:  # not `.to()`: see the note on the kernels in rackserve.kernels.attention
        pooled = round_to_bf16(tl.sum(round_to_bf16(kv * round_to_bf16(weight)), axis=0))
    else:
        pooled = tl.sum((kv * weight.to(OUT_DTYPE).to(tl.float32)).to(OUT_DTYPE).to(tl.float32), axis=0)
    tl.store(out_ptr + n * o_n + offs_c * o_c, pooled.to(OUT_DTYPE), mask=mask_c)


def compress_pool_triton(src: torch.Tensor, valid: torch.Tensor, position_bias: torch.Tensor | None,
                         overlap: bool) -> torch.Tensor:
    """Triton version of `compress_pool_torch` (same shapes and semantics).

    One program per (entry, block of output channels) loads all K slots of its channels, adds
    the slot bias, softmaxes over the slots in fp32 and sums the weighted kv. The weights and
    each product are rounded to src's dtype like the reference (round to nearest even), and the
    products summed in fp32: the two differ only in summation order, ≤ 1e-6 relative in fp32 and
    at most one bf16 ulp of the output in bf16 (equal on the test's inputs).
    """
    n, k, width2 = src.shape
    c = width2 // 2
    d = c // 2 if overlap else c
    out = torch.empty(n, d, dtype=src.dtype, device=src.device)
    if n == 0 or d == 0:
        return out
    if position_bias is None:  # a zero bias: the kernel's loads stay unconditional
        position_bias = torch.zeros(k // 2 if overlap else k, c, dtype=torch.float32, device=src.device)
    block_k = triton.next_power_of_2(k)
    block_c = max(16, min(64 if block_k <= 64 else 32, triton.next_power_of_2(d)))
    valid = valid.view(torch.uint8)
    _compress_pool_kernel[(n, triton.cdiv(d, block_c))](
        src, valid, position_bias, out, k, position_bias.shape[0], d, c,
        *src.stride(), *valid.stride(), *position_bias.stride(), *out.stride(),
        OVERLAP=bool(overlap), OUT_DTYPE=tl_dtype(src.dtype), ROUND_BF16=src.dtype == torch.bfloat16,
        BLOCK_K=block_k, BLOCK_C=block_c)
    return out
