"""Routed-expert FFN over tokens grouped by expert: gate_up GEMM, clamped SwiGLU, down GEMM,
weighted by each token's routing weight and summed back per token.

Shapes: T tokens, D hidden, E experts, I expert intermediate size, k experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU: silu(min(gate, limit)) · clamp(up, ±limit)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids `[T, k]` -> (order `[T·k]`: (token, slot) pairs sorted by expert, stable;
    counts `[E]`: pairs per expert). Pair p is token p // k, slot p % k."""
    flat = ids.flatten()
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_experts)


def moe_ffn_torch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, limit: float) -> torch.Tensor:
    """x `[T, D]`, ids/weights `[T, k]`, gate_up `[E, 2I, D]`, down `[E, D, I]` -> `[T, D]`
    = Σ_k weight · down_e(swiglu(gate_up_e · x))."""
    order, counts = group_by_expert(ids, gate_up.shape[0])
    token = order // ids.shape[1]
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    h = torch._grouped_mm(x[token], gate_up.transpose(1, 2), offs=offsets)
    gate, up = h.chunk(2, dim=-1)
    out = torch._grouped_mm(swiglu(gate, up, limit), down.transpose(1, 2), offs=offsets)
    out = out * weights.flatten()[order, None].to(out.dtype)
    return torch.zeros_like(x).index_add_(0, token, out)
