"""The lightning indexer's scores and its top-k choice of compressed entries per query.

score[t, e] = Σ_h w[t, h] · ReLU(q[t, h] · k_e) · d^-½ over the entries e the query may see.
Shapes: T queries, H indexer heads, d indexer head dim, E candidate entries per query.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rackserve.kernels.attention import gather_rows


def indexer_scores_torch(q: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, visible: torch.Tensor,
                         head_w: torch.Tensor) -> torch.Tensor:
    """q `[T, H, d]`, keys `[R, d]`, rows/visible `[T, E]`, head_w `[T, H]` -> scores `[T, E]` fp32,
    -inf where not visible."""
    k = gather_rows((keys,), rows)
    relu = F.relu(torch.einsum("thd,ted->the", q.float(), k.float())) * q.shape[-1] ** -0.5
    score = torch.einsum("the,th->te", relu, head_w.float())
    return score.masked_fill(~visible, float("-inf"))


def top_entries(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best entries per query: (positions `[T, min(k, E)]` into the E candidates, valid).

    Ties go to the lowest position (a stable sort), so the choice is the same whatever the batch.
    """
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    return order, scores.gather(1, order) > float("-inf")
