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

from rackserve.kernels.packed_rows import PackedRows, kernel_args, load_packed
from rackserve.kernels.triton_utils import dot_dtype, round_to_bf16, tl_dtype


def gather_rows(sources: Sequence[torch.Tensor | PackedRows], rows: torch.Tensor) -> torch.Tensor:
    """Rows of the virtual concatenation of `sources` (`[n_i, C]` each; packed rows are decoded as
    they are gathered): rows `[...]` -> `[..., C]`.

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


def sink_attention_torch(q: torch.Tensor, sources: Sequence[torch.Tensor | PackedRows], rows: torch.Tensor,
                         valid: torch.Tensor,
                         sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """q `[T, H, d]`; sources: key tensors `[n_i, d]` (or packed rows, decoded as gathered); rows/valid
    `[T, K]`; sinks `[H]` -> `[T, H, d]`.

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
        q_ptr, out_ptr, rows_ptr, valid_ptr, sinks_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
        src0_ptr, src1_ptr, src2_ptr, src2_words_ptr, n0, n1, n2,
        s0_row, s0_col, s1_row, s1_col, s2_row, s2_col, s2_scale_col, s2_block,
        H, D, K, SPAN, qk_scale,
        q_st, q_sh, q_sd, o_st, o_sh, o_sd, r_st, r_sk, v_st, v_sk,
        NUM_SOURCES: tl.constexpr, SRC2_BITS: tl.constexpr, SRC2_SCALE: tl.constexpr, IN_DTYPE: tl.constexpr,
        DOT_DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr,
        SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """Keys [split · SPAN, (split+1) · SPAN) of query t for a block of heads. Without SPLIT the
    program sees every key and writes the normalised output; with SPLIT it writes its partial
    softmax state (running max m and sum l, log2 domain, and the unnormalised acc) to
    `part_m/part_l/part_acc` for `_combine_kernel`, which folds in the sink. Source 2 may be
    packed rows (SRC2_BITS 8 or 4, scales SRC2_SCALE: `rackserve.kernels.packed_rows`), decoded here in
    registers."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h, mask_d = offs_h < H, offs_d < D

    q = tl.load(q_ptr + t * q_st + offs_h[:, None] * q_sh + offs_d[None, :] * q_sd,
                mask=mask_h[:, None] & mask_d[None, :], other=0.0).to(DOT_DTYPE)
    if SPLIT:
        # a finite floor instead of -inf: exp2(m - m_new) stays defined for splits with no valid key
        m = tl.full([BLOCK_H], -1.0e30, tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
    else:
        # The sink starts the running softmax (log2 domain): it is one more logit in the denominator
        # with no value, so m = sink, l = exp2(sink - m) = 1, acc = 0. It also keeps m finite, so a
        # block whose keys are all invalid needs no special case.
        m = tl.load(sinks_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32) * _LOG2E
        l = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)

    for k0 in range(split * SPAN, tl.minimum(K, (split + 1) * SPAN), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < tl.minimum(K, (split + 1) * SPAN)
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
            if SRC2_BITS == 0:
                part = tl.load(src2_ptr + local[:, None] * s2_row + offs_d[None, :] * s2_col,
                               mask=inside[:, None] & mask_d[None, :], other=0.0).to(IN_DTYPE)
            else:
                # rounded to the model dtype as the reference's decoded rows are (fp32 -> IN_DTYPE)
                part = load_packed(src2_ptr, src2_words_ptr, local, inside, offs_d, mask_d, s2_row, s2_scale_col,
                                   s2_block, SRC2_BITS, SRC2_SCALE)
                if ROUND_BF16:
                    part = round_to_bf16(part)
                part = part.to(IN_DTYPE)
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

    if SPLIT:
        # partial state, laid out [T, splits, H] and [T, splits, H, BLOCK_D]
        at = (t * tl.num_programs(2) + split) * H + offs_h
        tl.store(part_m_ptr + at, m, mask=mask_h)
        tl.store(part_l_ptr + at, l, mask=mask_h)
        tl.store(part_acc_ptr + at[:, None] * BLOCK_D + offs_d[None, :], acc, mask=mask_h[:, None])
    else:
        _store_out(out_ptr, acc / l[:, None], t, offs_h, offs_d, mask_h, mask_d, o_st, o_sh, o_sd, IN_DTYPE,
                   ROUND_BF16)


@triton.jit
def _store_out(out_ptr, out, t, offs_h, offs_d, mask_h, mask_d, o_st, o_sh, o_sd, IN_DTYPE: tl.constexpr,
               ROUND_BF16: tl.constexpr):
    if ROUND_BF16:
        out = round_to_bf16(out)
    tl.store(out_ptr + t * o_st + offs_h[:, None] * o_sh + offs_d[None, :] * o_sd, out.to(IN_DTYPE),
             mask=mask_h[:, None] & mask_d[None, :])


@triton.jit
def _combine_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, sinks_ptr, out_ptr, H, D, SPLITS,
                    o_st, o_sh, o_sd, IN_DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Merge the split partial softmax states of query t, starting from the sink logit."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h, mask_d = offs_h < H, offs_d < D
    m = tl.load(sinks_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32) * _LOG2E
    l = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for split in range(0, SPLITS):
        at = (t * SPLITS + split) * H + offs_h
        m_s = tl.load(part_m_ptr + at, mask=mask_h, other=-1.0e30)
        m_new = tl.maximum(m, m_s)
        alpha, beta = tl.exp2(m - m_new), tl.exp2(m_s - m_new)
        l = l * alpha + tl.load(part_l_ptr + at, mask=mask_h, other=0.0) * beta
        acc_s = tl.load(part_acc_ptr + at[:, None] * BLOCK_D + offs_d[None, :], mask=mask_h[:, None], other=0.0)
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        m = m_new
    _store_out(out_ptr, acc / l[:, None], t, offs_h, offs_d, mask_h, mask_d, o_st, o_sh, o_sd, IN_DTYPE,
               ROUND_BF16)


def sink_attention_triton(q: torch.Tensor, sources: Sequence[torch.Tensor | PackedRows], rows: torch.Tensor,
                          valid: torch.Tensor,
                          sinks: torch.Tensor, scale: float, splits: int | None = None) -> torch.Tensor:
    """Triton version of `sink_attention_torch` (same shapes and semantics).

    A program takes one query and a block of heads and walks keys BLOCK_K at a time: each key row
    is fetched from whichever source holds it (one masked load per source, merged; no copy of the
    sources), scored against every head of the block with one `tl.dot`, and folded into an fp32
    online softmax. Values are the same key tile.

    Two launch shapes. Prefill chunks have many queries: one program per (query, head block) sees
    all of its keys and starts the softmax from the sink. Decode has one query per request, too
    few programs to fill a GPU when keys are many: the keys are split over `splits` programs
    (flash-decoding), each writes its partial softmax state, and `_combine_kernel` merges them and
    the sink. `splits` defaults to what fills ~128 programs; 1 forces the unsplit shape.

    A further prefill refinement: consecutive queries of a request share W-1 window keys, so a
    program taking a block of queries could walk the union of their key rows once with a
    per-(query, key) mask, loading each key once per query block instead of once per query.
    """
    t, h, d = q.shape
    k = rows.shape[1]
    out = torch.empty_like(q)
    if t == 0 or h == 0:
        return out
    if not 1 <= len(sources) <= 3:
        raise ValueError(f"sink_attention_triton takes 1 to 3 key sources, got {len(sources)}")
    if any(isinstance(s, PackedRows) for s in sources[:2]):
        raise ValueError("only the third key source (the compressed entries) may be packed rows")
    # the third source's bytes, fp32 words (scales), scale column, block, bits (0: not packed), scale format
    s2_data, s2_words, s2_scale_col, s2_block, s2_bits, s2_scale = kernel_args(sources[2] if len(sources) == 3 else q)
    # an empty source is never read: any pointer will do
    srcs = [(s, s.shape[0], s.stride(0), s.stride(1)) if s.shape[0] else (q, 0, 0, 0)
            for s in [*sources[:2], s2_data][:len(sources)]]
    srcs += [(q, 0, 0, 0)] * (3 - len(srcs))
    (s0, n0, s0r, s0c), (s1, n1, s1r, s1c), (s2, n2, s2r, s2c) = srcs
    s2_words = s2_words if n2 else q

    # Tiles sized to stay under 255 registers without spills for bf16 on sm_90 (checked with an
    # offline compile): the gathered key tile needs a 64-bit pointer per element.
    block_d = max(16, triton.next_power_of_2(d))
    block_h = 16 if block_d >= 256 else min(64, max(16, triton.next_power_of_2(h)))
    block_k = 16 if block_d >= 512 else 32
    head_blocks = triton.cdiv(h, block_h)
    if splits is None:
        splits = max(1, min(triton.cdiv(k, 4 * block_k), 128 // (t * head_blocks)))
    span = max(block_k, triton.cdiv(triton.cdiv(k, splits), block_k) * block_k)
    splits = max(1, triton.cdiv(k, span))
    split = splits > 1
    part_m = torch.empty(t, splits, h, dtype=torch.float32, device=q.device) if split else out
    part_l = torch.empty_like(part_m) if split else out
    part_acc = torch.empty(t, splits, h, block_d, dtype=torch.float32, device=q.device) if split else out
    valid = valid.view(torch.uint8)
    common = dict(IN_DTYPE=tl_dtype(q.dtype), ROUND_BF16=q.dtype == torch.bfloat16, BLOCK_H=block_h,
                  BLOCK_D=block_d)
    _sink_attention_kernel[(t, head_blocks, splits)](
        q, out, rows, valid, sinks, part_m, part_l, part_acc,
        s0, s1, s2, s2_words, n0, n1, n2, s0r, s0c, s1r, s1c, s2r, s2c, s2_scale_col, s2_block,
        h, d, k, span, float(scale) * _LOG2E.value,
        *q.stride(), *out.stride(), *rows.stride(), *valid.stride(),
        NUM_SOURCES=max(2, len(sources)), SRC2_BITS=s2_bits, SRC2_SCALE=s2_scale, DOT_DTYPE=dot_dtype(q), SPLIT=split,
        BLOCK_K=block_k,
        num_warps=4 if block_h * block_d <= 2048 else 8, **common)
    if split:
        _combine_kernel[(t, head_blocks)](part_m, part_l, part_acc, sinks, out, h, d, splits, *out.stride(),
                                          **common)
    return out
