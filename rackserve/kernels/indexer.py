"""The lightning indexer's scores and its top-k choice of compressed entries per query.

score[t, e] = Σ_h w[t, h] · ReLU(q[t, h] · k_e) · d^-½ over the entries e the query may see.
Shapes: T queries, H indexer heads, d indexer head dim, E candidate entries per query.

What the top-k promises, on any hardware: the k candidates with the highest scores *as computed*,
best first, and among candidates whose computed scores are equal, the lowest position first (so
the tie rule does not depend on the batch). Scores are fp32 sums whose order differs between
implementations, tile shapes and CPUs (the Triton interpreter's `tl.dot` is numpy's BLAS, whose
kernel depends on the CPU's SIMD width; a GPU's MMA tiles differ again), so two implementations,
or one key seen at two positions of a tile, may differ in the last bits. Against the reference the
choice is therefore the same up to near-ties: the i-th pick's reference score is within the fp32
tolerance of the reference's i-th best score. Ties that are exact in any summation order stay
exact and follow the rule everywhere: entries no head scores above zero (every ReLU 0, the common
tie on random weights) and invisible ones (-inf); `tests/test_kernels_attention.py` checks both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rackserve.kernels.packed_rows import PackedRows, kernel_args, load_packed
from rackserve.kernels.triton_utils import dot_dtype, round_to_bf16, tl_dtype


def indexer_scores_torch(q: torch.Tensor, keys: torch.Tensor | PackedRows, rows: torch.Tensor, visible: torch.Tensor,
                         head_w: torch.Tensor) -> torch.Tensor:
    """q `[T, H, d]`, keys `[R, d]` (or packed rows, decoded as gathered), rows/visible `[T, E]`,
    head_w `[T, H]` -> scores `[T, E]` fp32, -inf where not visible."""
    k = keys[rows]
    relu = F.relu(torch.einsum("thd,ted->the", q.float(), k.float())) * q.shape[-1] ** -0.5
    score = torch.einsum("the,th->te", relu, head_w.float())
    return score.masked_fill(~visible, float("-inf"))


@triton.jit
def _score_block(q, w, t, e0, rows_ptr, visible_ptr, keys_ptr, words_ptr, E, R, r_st, r_se, v_st, v_se, k_r, k_c,
                 scale_col, block, offs_d, mask_d, KEY_BITS: tl.constexpr, KEY_SCALE: tl.constexpr,
                 KEY_DTYPE: tl.constexpr, KEY_BF16: tl.constexpr, DOT_DTYPE: tl.constexpr, BLOCK_E: tl.constexpr):
    """Scores of candidates e0 .. e0+BLOCK_E of query t (q `[BLOCK_H, BLOCK_D]`, w `[BLOCK_H]` already
    scaled): (offsets `[BLOCK_E]`, in range, scores with -inf where not visible). With KEY_BITS 8 or
    4 the keys are packed rows (scales KEY_SCALE: `rackserve.kernels.packed_rows`), decoded here and
    rounded to KEY_DTYPE as the reference decodes them."""
    offs_e = e0 + tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    row = tl.load(rows_ptr + t * r_st + offs_e * r_se, mask=mask_e, other=-1)
    seen = (tl.load(visible_ptr + t * v_st + offs_e * v_se, mask=mask_e, other=0) != 0) & mask_e
    inside = seen & (row >= 0) & (row < R)
    if KEY_BITS == 0:
        key = tl.load(keys_ptr + row[:, None] * k_r + offs_d[None, :] * k_c,
                      mask=inside[:, None] & mask_d[None, :], other=0.0).to(DOT_DTYPE)
    else:
        key = load_packed(keys_ptr, words_ptr, row, inside, offs_d, mask_d, k_r, scale_col, block, KEY_BITS,
                          KEY_SCALE)
        if KEY_BF16:  # rounded first: the interpreter's cast truncates
            key = round_to_bf16(key)
        key = key.to(KEY_DTYPE).to(DOT_DTYPE)
    s = tl.maximum(tl.dot(q, tl.trans(key), input_precision="ieee"), 0.0)  # [BLOCK_H, BLOCK_E]
    score = tl.sum(s * w[:, None], axis=0)
    return offs_e, mask_e, tl.where(seen, score, float("-inf"))


@triton.jit
def _load_query(q_ptr, w_ptr, t, H, D, sm_scale, q_st, q_sh, q_sd, w_st, w_sh,
                DOT_DTYPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Every head's query `[BLOCK_H, BLOCK_D]` and head weight × d^-½ `[BLOCK_H]` of query t."""
    offs_h, offs_d = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D)
    mask_h = offs_h < H
    q = tl.load(q_ptr + t * q_st + offs_h[:, None] * q_sh + offs_d[None, :] * q_sd,
                mask=mask_h[:, None] & (offs_d < D)[None, :], other=0.0).to(DOT_DTYPE)
    w = tl.load(w_ptr + t * w_st + offs_h * w_sh, mask=mask_h, other=0.0).to(tl.float32) * sm_scale
    return q, w


@triton.jit
def _indexer_scores_kernel(
        q_ptr, keys_ptr, words_ptr, rows_ptr, visible_ptr, w_ptr, out_ptr, H, D, E, R, SPAN, sm_scale,
        q_st, q_sh, q_sd, k_r, k_c, scale_col, block, r_st, r_se, v_st, v_se, w_st, w_sh, o_st, o_se,
        KEY_BITS: tl.constexpr, KEY_SCALE: tl.constexpr, KEY_DTYPE: tl.constexpr, KEY_BF16: tl.constexpr,
        DOT_DTYPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * SPAN
    offs_d = tl.arange(0, BLOCK_D)
    # every head's query once per program, reused for SPAN entries
    q, w = _load_query(q_ptr, w_ptr, t, H, D, sm_scale, q_st, q_sh, q_sd, w_st, w_sh, DOT_DTYPE, BLOCK_H, BLOCK_D)
    for e0 in range(start, tl.minimum(start + SPAN, E), BLOCK_E):
        offs_e, mask_e, score = _score_block(q, w, t, e0, rows_ptr, visible_ptr, keys_ptr, words_ptr, E, R, r_st, r_se,
                                             v_st, v_se, k_r, k_c, scale_col, block, offs_d, offs_d < D, KEY_BITS,
                                             KEY_SCALE, KEY_DTYPE, KEY_BF16, DOT_DTYPE, BLOCK_E)
        tl.store(out_ptr + t * o_st + offs_e * o_se, score, mask=mask_e)


@triton.jit
def _merge_top(best, score, offs_e, mask_e, BLOCK_K: tl.constexpr):
    """The running top-BLOCK_K `best` (int64 keys) merged with a block of BLOCK_K candidates.

    Each candidate becomes one int64 key, (order-preserving bits of its score) << 32 | (2³¹−1 − e),
    so a descending top-k is by score, then lowest index: the same order as a stable sort.
    """
    lowest = -9223372036854775807 - 1
    bits = (score + 0.0).to(tl.int32, bitcast=True)  # + 0.0 turns -0.0 into 0.0: they tie
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    key = tl.where(mask_e, (ordered << 32) | (0x7FFFFFFF - offs_e).to(tl.int64), lowest)
    return tl.topk(tl.join(best, key).reshape([2 * BLOCK_K]), BLOCK_K)


@triton.jit
def _store_top(best, order_ptr, valid_ptr, t, K, BLOCK_K: tl.constexpr):
    """The k best of query t from the merged keys: positions (best first) and whether each is visible."""
    ranks = tl.arange(0, BLOCK_K)
    bits = (best >> 32).to(tl.int32)
    valid = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.float32, bitcast=True) > float("-inf")
    tl.store(order_ptr + t * K + ranks, 0x7FFFFFFF - (best & 0xFFFFFFFF), mask=ranks < K)
    tl.store(valid_ptr + t * K + ranks, valid.to(tl.int8), mask=ranks < K)


@triton.jit
def _indexer_topk_kernel(
        q_ptr, keys_ptr, words_ptr, rows_ptr, visible_ptr, w_ptr, order_ptr, valid_ptr, H, D, E, R, K, sm_scale,
        q_st, q_sh, q_sd, k_r, k_c, scale_col, block, r_st, r_se, v_st, v_se, w_st, w_sh,
        KEY_BITS: tl.constexpr, KEY_SCALE: tl.constexpr, KEY_DTYPE: tl.constexpr, KEY_BF16: tl.constexpr,
        DOT_DTYPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program per query: scores BLOCK_K candidates at a time and keeps a running top-BLOCK_K."""
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    q, w = _load_query(q_ptr, w_ptr, t, H, D, sm_scale, q_st, q_sh, q_sd, w_st, w_sh, DOT_DTYPE, BLOCK_H, BLOCK_D)
    best = tl.full([BLOCK_K], -9223372036854775807 - 1, tl.int64)
    for e0 in range(0, E, BLOCK_K):
        offs_e, mask_e, score = _score_block(q, w, t, e0, rows_ptr, visible_ptr, keys_ptr, words_ptr, E, R, r_st, r_se,
                                             v_st, v_se, k_r, k_c, scale_col, block, offs_d, offs_d < D, KEY_BITS,
                                             KEY_SCALE, KEY_DTYPE, KEY_BF16, DOT_DTYPE, BLOCK_K)
        best = _merge_top(best, score, offs_e, mask_e, BLOCK_K)
    _store_top(best, order_ptr, valid_ptr, t, K, BLOCK_K)


@triton.jit
def _top_of_scores_kernel(scores_ptr, order_ptr, valid_ptr, E, K, s_st, s_se, BLOCK_K: tl.constexpr):
    """One program per query: the running top-BLOCK_K of its stored scores `[E]`, BLOCK_K at a time."""
    t = tl.program_id(0).to(tl.int64)
    best = tl.full([BLOCK_K], -9223372036854775807 - 1, tl.int64)
    for e0 in range(0, E, BLOCK_K):
        offs_e = e0 + tl.arange(0, BLOCK_K)
        mask_e = offs_e < E
        score = tl.load(scores_ptr + t * s_st + offs_e * s_se, mask=mask_e, other=float("-inf"))
        best = _merge_top(best, score, offs_e, mask_e, BLOCK_K)
    _store_top(best, order_ptr, valid_ptr, t, K, BLOCK_K)


def _key_args(q: torch.Tensor, keys: torch.Tensor | PackedRows) -> tuple[tuple, dict]:
    """The keys' kernel arguments (bytes or tensor, fp32 words, strides, scale column, block) and
    constexprs (bits, scale format, the dtype keys are read in, the dot's operand dtype)."""
    data, words, scale_col, block, bits, scale = kernel_args(keys)
    # the dot takes one operand dtype: mixed inputs meet in fp32, which loses nothing
    dot = dot_dtype(q) if q.dtype == keys.dtype else tl.float32
    return ((data, words if data.shape[0] else data, *data.stride(), scale_col, block),
            dict(KEY_BITS=bits, KEY_SCALE=scale, KEY_DTYPE=tl_dtype(keys.dtype), KEY_BF16=keys.dtype == torch.bfloat16,
                 DOT_DTYPE=dot))


def indexer_scores_triton(q: torch.Tensor, keys: torch.Tensor | PackedRows, rows: torch.Tensor, visible: torch.Tensor,
                          head_w: torch.Tensor) -> torch.Tensor:
    """Triton version of `indexer_scores_torch` (same shapes and semantics).

    One program per (query, span of entries) loads the query's heads and weights once, then walks
    its span BLOCK_E entries at a time: gather the key rows, one `tl.dot` for all heads, ReLU and
    the weighted sum over heads, all in fp32 accumulation.
    """
    t, h, d = q.shape
    e = rows.shape[1]
    out = torch.empty(t, e, dtype=torch.float32, device=q.device)
    if t == 0 or e == 0:
        return out
    block_e = 32
    span = 4 * block_e
    visible = visible.view(torch.uint8)
    (data, words, k_r, k_c, scale_col, block), consts = _key_args(q, keys)
    _indexer_scores_kernel[(t, triton.cdiv(e, span))](
        q, data, words, rows, visible, head_w, out, h, d, e, keys.shape[0], span, d**-0.5,
        *q.stride(), k_r, k_c, scale_col, block, *rows.stride(), *visible.stride(), *head_w.stride(), *out.stride(),
        **consts, BLOCK_H=max(16, triton.next_power_of_2(h)),
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_E=block_e)
    return out


def indexer_topk_torch(q: torch.Tensor, keys: torch.Tensor | PackedRows, rows: torch.Tensor, visible: torch.Tensor,
                       head_w: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best candidates of each query: (positions `[T, min(k, E)]` into its E candidates, best
    first, and whether each is a visible entry). Scores as `indexer_scores_torch`; ties go to the
    lowest position, so the choice is the same whatever the batch."""
    return top_entries(indexer_scores_torch(q, keys, rows, visible, head_w), k)


def indexer_topk_triton(q: torch.Tensor, keys: torch.Tensor | PackedRows, rows: torch.Tensor, visible: torch.Tensor,
                        head_w: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `indexer_topk_torch`: scores fused with a running top-k, one program per
    query, so the `[T, E]` scores never reach memory (E grows with the context: 25K entries at
    100K tokens).

    Packed keys (FP8/FP4 state) are scored by `indexer_scores_triton` first and the top-k then taken
    from the stored scores (`_top_of_scores_kernel`): decoding a 512-candidate tile of packed keys to
    fp32 beside the fused top-k needs 413,696 B of shared memory on sm_90, more than a block gets
    (227 KiB); apart, the two need ~41 KB and ~16 KB, for one `[T, E]` fp32 write and read. Plain keys
    go through the fused kernel unpipelined (`num_stages=1`): pipelined, two buffers of its 512-row key
    tile make it 287,232 B on sm_90 (compiled as a launch compiles it), unpipelined 147,456 B.
    """
    t, h, d = q.shape
    e = rows.shape[1]
    k = min(k, e)
    order = torch.empty(t, k, dtype=torch.int64, device=q.device)
    valid = torch.empty(t, k, dtype=torch.bool, device=q.device)
    if t == 0 or k == 0:
        return order, valid
    block_k = max(16, triton.next_power_of_2(k))
    if isinstance(keys, PackedRows):
        scores = indexer_scores_triton(q, keys, rows, visible, head_w)
        _top_of_scores_kernel[(t,)](scores, order, valid.view(torch.int8), e, k, *scores.stride(), BLOCK_K=block_k)
        return order, valid
    visible = visible.view(torch.uint8)
    (data, words, k_r, k_c, scale_col, block), consts = _key_args(q, keys)
    _indexer_topk_kernel[(t,)](
        q, data, words, rows, visible, head_w, order, valid.view(torch.int8), h, d, e, keys.shape[0], k, d**-0.5,
        *q.stride(), k_r, k_c, scale_col, block, *rows.stride(), *visible.stride(), *head_w.stride(),
        **consts, BLOCK_H=max(16, triton.next_power_of_2(h)), BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_K=block_k, num_stages=1)
    return order, valid


def top_entries(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best entries per query: (positions `[T, min(k, E)]` into the E candidates, valid).

    Ties go to the lowest position (a stable sort), so the choice is the same whatever the batch.
    """
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    return order, scores.gather(1, order) > float("-inf")
