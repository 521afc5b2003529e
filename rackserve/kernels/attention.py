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


def gather_rows(sources: Sequence[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """Rows of the virtual concatenation of `sources` (`[n_i, C]` each): rows `[...]` -> `[..., C]`.
    Rows past the end read zeros."""
    out, base = None, 0
    for src in sources:
        n = src.shape[0]
        if n:
            local = rows - base
            inside = (local >= 0) & (local < n)
            part = src[local.clamp(0, n - 1)]
            part = part.masked_fill(~inside.unsqueeze(-1), 0)
            out = part if out is None else out + part
        base += n
    if out is None:
        return torch.zeros(*rows.shape, sources[0].shape[-1], dtype=sources[0].dtype, device=rows.device)
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
