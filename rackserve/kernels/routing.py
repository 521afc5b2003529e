"""MoE routing: expert scores, the k experts of each token and their weights.

Shapes: T tokens, E routed experts, k experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SCORING = ("sqrtsoftplus", "sigmoid", "softmax")


def expert_scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    if scoring == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(dim=-1, dtype=torch.float32)


def route_torch(logits: torch.Tensor, k: int, scoring: str, scale: float, bias: torch.Tensor | None = None,
                hash_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits `[T, E]` -> (expert ids `[T, k]` int64, weights `[T, k]`).

    Learned routing picks the k best `score + bias` (bias `[E]`, the load-balancing correction);
    hash routing takes the given `hash_ids [T, k]`. Either way the weights are the picked experts'
    scores, renormalised to sum to 1, times `scale`.
    """
    scores = expert_scores(logits, scoring)
    if hash_ids is not None:
        ids = hash_ids.long()
    else:
        ids = torch.topk(scores + bias, k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    return ids, weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scale


# --- Triton ----------------------------------------------------------------------------------------

_SCORING_CODE = {name: code for code, name in enumerate(SCORING)}


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, hash_ptr, ids_ptr, weights_ptr, E, K, scale,
                  stride_lt, stride_ht, stride_ot,
                  SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, HASHED: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, K_STATIC: tl.constexpr):
    """One token per program: its E scores live in one block, the k picks in another."""
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)
    mask_e = offs_e < E
    mask_k = offs_k < K
    x = tl.load(logits_ptr + t * stride_lt + offs_e, mask=mask_e, other=float("-inf")).to(tl.float32)
    if SCORING == 0:  # sqrtsoftplus; softplus as torch's: x above 20 is x itself
        u = tl.exp(tl.minimum(x, 20.0))
        w = 1.0 + u
        # log1p(u) without log1p: exact where 1 + u rounds to 1, and accurate elsewhere (Goldberg)
        exact = w == 1.0
        log1p = tl.where(exact, u, tl.log(w) * (u / tl.where(exact, 1.0, w - 1.0)))
        scores = tl.sqrt(tl.where(x > 20.0, x, log1p))
    elif SCORING == 1:  # sigmoid
        scores = tl.sigmoid(x)
    else:  # softmax over the row
        p = tl.exp(x - tl.max(x, axis=0))  # masked lanes: exp(-inf) = 0
        scores = p / tl.sum(p, axis=0)
    scores = tl.where(mask_e, scores, 0.0)

    if HASHED:
        ids = tl.load(hash_ptr + t * stride_ht + offs_k, mask=mask_k, other=0).to(tl.int32)
    else:
        keys = scores
        if HAS_BIAS:
            keys += tl.load(bias_ptr + offs_e, mask=mask_e, other=0.0).to(tl.float32)
        keys = tl.where(mask_e, keys, float("-inf"))
        ids = tl.zeros([BLOCK_K], dtype=tl.int32)
        # k rounds of argmax (lowest index on ties), each removing its pick
        for i in tl.static_range(K_STATIC):
            best = tl.max(keys, axis=0)
            pick = tl.min(tl.where(keys == best, offs_e, BLOCK_E), axis=0)
            ids = tl.where(offs_k == i, pick, ids)
            keys = tl.where(offs_e == pick, float("-inf"), keys)

    # gather each pick's score: [BLOCK_K, BLOCK_E] one-hot, reduced over E
    hit = (ids[:, None] == offs_e[None, :]) & mask_k[:, None]
    picked = tl.sum(tl.where(hit, scores[None, :], 0.0), axis=1)
    weights = picked / (tl.sum(picked, axis=0) + 1e-20) * scale
    tl.store(ids_ptr + t * stride_ot + offs_k, ids.to(tl.int64), mask=mask_k)
    tl.store(weights_ptr + t * stride_ot + offs_k, weights, mask=mask_k)


def route_triton(logits: torch.Tensor, k: int, scoring: str, scale: float, bias: torch.Tensor | None = None,
                 hash_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_torch` as one Triton program per token.

    Differences from the reference, all deliberate: scores are computed in fp32 whatever the
    logits' dtype and the weights come back float32; learned routing without `bias` picks by the
    plain scores (the reference needs a bias); among exactly tied `score + bias` the lowest
    expert id wins (the reference's `topk` leaves ties unspecified).
    """
    if scoring not in _SCORING_CODE:
        raise ValueError(f"scoring={scoring!r} is not a routing score; use one of {SCORING}")
    num_tokens, num_experts = logits.shape
    if not 1 <= k <= min(num_experts, 16):
        raise ValueError(f"k={k} experts per token: route_triton needs 1 ≤ k ≤ min(E={num_experts}, 16)")
    if hash_ids is not None and hash_ids.shape != (num_tokens, k):
        raise ValueError(f"hash_ids has shape {tuple(hash_ids.shape)}; expected [T, k] = {[num_tokens, k]}")
    logits = logits.contiguous()
    ids = torch.empty(num_tokens, k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(num_tokens, k, dtype=torch.float32, device=logits.device)
    if num_tokens == 0:
        return ids, weights
    hashed = hash_ids is not None
    hash_arg = hash_ids.contiguous() if hashed else ids  # placeholder pointer, never read
    bias_arg = bias.contiguous() if bias is not None else logits  # placeholder pointer, never read
    _route_kernel[(num_tokens,)](
        logits, bias_arg, hash_arg, ids, weights, num_experts, k, float(scale),
        logits.stride(0), hash_arg.stride(0), ids.stride(0),
        SCORING=_SCORING_CODE[scoring], HAS_BIAS=bias is not None and not hashed, HASHED=hashed,
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=triton.next_power_of_2(k), K_STATIC=k,
        num_warps=4 if num_experts >= 256 else 1)
    return ids, weights
