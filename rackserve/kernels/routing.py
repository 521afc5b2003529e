"""MoE routing: expert scores, the k experts of each token and their weights.

Shapes: T tokens, E routed experts, k experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
