"""Compressor pooling: softmax-gated sums that turn windows of tokens into compressed entries.

Each entry pools K source rows `[kv | gate]`. Without overlap (HCA) the K = rate rows are one
window and C = d. With overlap (CSA) each row carries two series (C = 2d): the entry pools the
first series (Ca, channels :d) of the previous window's rate rows and the second series (Cb,
channels d:) of its own window's rate rows, K = 2·rate. The gate gets a learned per-slot bias;
invalid slots (the window before entry 0) get zero weight.
"""

from __future__ import annotations

import torch


def compress_pool_torch(src: torch.Tensor, valid: torch.Tensor, position_bias: torch.Tensor,
                        overlap: bool) -> torch.Tensor:
    """src `[N, K, 2C]` (`[kv | gate]` per slot), valid `[N, K]`, position_bias `[rate, C]` fp32
    -> pooled `[N, d]` in src's dtype (d = C/2 with overlap, else C). Softmax in fp32."""
    kv, gate = src.chunk(2, dim=-1)
    if overlap:
        d, m = kv.shape[-1] // 2, position_bias.shape[0]
        kv = torch.cat([kv[:, :m, :d], kv[:, m:, d:]], dim=1)
        gate = torch.cat([gate[:, :m, :d] + position_bias[:, :d], gate[:, m:, d:] + position_bias[:, d:]], dim=1)
    else:
        gate = gate + position_bias
    gate = gate.masked_fill(~valid.unsqueeze(-1), float("-inf"))
    weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
    return (kv * weights).sum(dim=1)
