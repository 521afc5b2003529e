"""V4 attention for a ragged batch: each query attends to its own list of keys (K = V).

A query's keys are its request's sliding window plus the compressed entries it may see (HCA: all
complete ones; CSA: the indexer's top-k). They live in several tensors (the window rings, this
step's new rows, the entry pages), addressed as rows of their virtual concatenation, so no key is
copied before the kernel reads it. Each head has a sink logit that takes probability mass but
contributes no value.

Shapes: T queries, H heads, d head dim, K keys per query.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from rackserve.kernels.triton_utils import dot_dtype, round_to_bf16, tl_dtype


def gather_rows(sources: Sequence[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """Rows of the virtual concatenation of `sources` (`[n_i, C]` each): rows `[...]` -> `[..., C]`.

    One gather per source, merged by which source each row falls in; the sources themselves are
    never concatenated (the entry pages can be most of the state memory).
    """
    out, base = None, 0
    for src in sources:
        n = src.shape[0]
        if n:
            part = src[(rows - base).clamp(0, n - 1)]
            out = part if out is None else torch.where((rows >= base).unsqueeze(-1), part, out)
        base += n
    return out


def sink_attention_torch(q: torch.Tensor, sources: Sequence[torch.Tensor], rows: torch.Tensor, valid: torch.Tensor,
                         sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """q `[T, H, d]`; sources: key tensors `[n_i, d]`; rows/valid `[T, K]`; sinks `[H]` -> `[T, H, d]`.

    softmax over [q·k · scale for valid keys, sink_h], values = keys, sink dropped. fp32 softmax.
    """
    keys = gather_rows(sources, rows).masked_fill(~valid.unsqueeze(-1), 0)
    logits = torch.einsum("thd,tkd->thk", q, keys).float() * scale
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    sink = sinks.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
    probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs.to(keys.dtype), keys)


# ---------------------------------------------------------------------------------------------
# Triton (helpers and the interpreter's caveats: rackserve.kernels.triton_utils)

_LOG2E = tl.constexpr(1.4426950408889634)  # the kernel works in exp2


@triton.jit
def _sink_attention_kernel(
        q_ptr, out_ptr, rows_ptr, valid_ptr, sinks_ptr,
        src0_ptr, src1_ptr, src2_ptr, n0, n1, n2,
        s0_row, s0_col, s1_row, s1_col, s2_row, s2_col,
        H, D, K, qk_scale,
        q_st, q_sh, q_sd, o_st, o_sh, o_sd, r_st, r_sk, v_st, v_sk,
        NUM_SOURCES: tl.constexpr, IN_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h, mask_d = offs_h < H, offs_d < D

    q = tl.load(q_ptr + t * q_st + offs_h[:, None] * q_sh + offs_d[None, :] * q_sd,
                mask=mask_h[:, None] & mask_d[None, :], other=0.0).to(DOT_DTYPE)
    # The sink starts the running softmax (log2 domain): it is one more logit in the denominator
    # with no value, so m = sink, l = exp2(sink - m) = 1, acc = 0. It also keeps m finite, so a
    # block whose keys are all invalid needs no special case.
    m = tl.load(sinks_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32) * _LOG2E
    l = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)

    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        row = tl.load(rows_ptr + t * r_st + offs_k * r_sk, mask=mask_k, other=-1)
        ok = (tl.load(valid_ptr + t * v_st + offs_k * v_sk, mask=mask_k, other=0) != 0) & mask_k

        # one key row serves every head (K = V); each source answers for its own row range. The
        # parts are merged with `where`, not `+`: no arithmetic on bf16 (the interpreter's is wrong)
        # and no fp32 copy of the tile.
        inside = ok & (row >= 0) & (row < n0)
        key = tl.load(src0_ptr + row[:, None] * s0_row + offs_d[None, :] * s0_col,
                      mask=inside[:, None] & mask_d[None, :], other=0.0).to(IN_DTYPE)
        local = row - n0
        inside = ok & (local >= 0) & (local < n1)
        part = tl.load(src1_ptr + local[:, None] * s1_row + offs_d[None, :] * s1_col,
                       mask=inside[:, None] & mask_d[None, :], other=0.0).to(IN_DTYPE)
        key = tl.where(inside[:, None], part, key)
        if NUM_SOURCES == 3:
            local = local - n1
            inside = ok & (local >= 0) & (local < n2)
            part = tl.load(src2_ptr + local[:, None] * s2_row + offs_d[None, :] * s2_col,
                           mask=inside[:, None] & mask_d[None, :], other=0.0).to(IN_DTYPE)
            key = tl.where(inside[:, None], part, key)
        key = key.to(DOT_DTYPE)

        s = tl.dot(q, tl.trans(key), input_precision="ieee") * qk_scale  # [BLOCK_H, BLOCK_K]
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        # probabilities are rounded to the input dtype before the value product, as the reference does
        if ROUND_BF16:
            p = round_to_bf16(p)
        p = p.to(IN_DTYPE).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p, key, input_precision="ieee")
        m = m_new

    out = acc / l[:, None]
    if ROUND_BF16:
        out = round_to_bf16(out)
    tl.store(out_ptr + t * o_st + offs_h[:, None] * o_sh + offs_d[None, :] * o_sd, out.to(IN_DTYPE),
             mask=mask_h[:, None] & mask_d[None, :])


def sink_attention_triton(q: torch.Tensor, sources: Sequence[torch.Tensor], rows: torch.Tensor, valid: torch.Tensor,
                          sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """Triton version of `sink_attention_torch` (same shapes and semantics).

    One program per (query, block of heads) walks the query's K keys BLOCK_K at a time: each key
    row is fetched from whichever source holds it (one masked load per source, merged; no copy
    of the sources), scored against every head of the block with one `tl.dot`, and folded into an
    fp32 online softmax that starts from the sink logit. Values are the same key tile.

    This per-query design suits decode (one query per request). In a prefill chunk consecutive
    queries of a request share W-1 of their window keys; a prefill-tiled variant would give a
    program a block of queries × heads of one request, walk the union of their key rows once
    (the request's window plus its visible entries) with a per-(query, key) validity mask, and
    so load each key once per query block instead of once per query.
    """
    t, h, d = q.shape
    k = rows.shape[1]
    out = torch.empty_like(q)
    if t == 0 or h == 0:
        return out
    if not 1 <= len(sources) <= 3:
        raise ValueError(f"sink_attention_triton takes 1 to 3 key sources, got {len(sources)}")
    srcs = [(s, s.shape[0], s.stride(0), s.stride(1)) if s.shape[0] else (q, 0, 0, 0) for s in sources]
    srcs += [(q, 0, 0, 0)] * (3 - len(srcs))  # an empty source is never read: any pointer will do
    (s0, n0, s0r, s0c), (s1, n1, s1r, s1c), (s2, n2, s2r, s2c) = srcs

    # Tiles sized to stay under 255 registers without spills for bf16 on sm_90 (checked with an
    # offline compile): the gathered key tile needs a 64-bit pointer per element.
    block_d = max(16, triton.next_power_of_2(d))
    block_h = 16 if block_d >= 256 else min(64, max(16, triton.next_power_of_2(h)))
    block_k = 16 if block_d >= 512 else 32
    valid = valid.view(torch.uint8)
    grid = (t, triton.cdiv(h, block_h))
    _sink_attention_kernel[grid](
        q, out, rows, valid, sinks,
        s0, s1, s2, n0, n1, n2, s0r, s0c, s1r, s1c, s2r, s2c,
        h, d, k, float(scale) * _LOG2E.value,
        *q.stride(), *out.stride(), *rows.stride(), *valid.stride(),
        NUM_SOURCES=max(2, len(sources)), IN_DTYPE=tl_dtype(q.dtype), DOT_DTYPE=dot_dtype(q),
        ROUND_BF16=q.dtype == torch.bfloat16,
        BLOCK_H=block_h, BLOCK_K=block_k, BLOCK_D=block_d, num_warps=4 if block_h * block_d <= 2048 else 8)
    return out
