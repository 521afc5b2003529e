"""Qwen3-MoE's feed-forward blocks: the sparse one (a softmax top-k router over routed experts,
`rackserve.models.moe`, with expert parallelism; no shared expert) and the dense SwiGLU MLP of the
layers `mlp_only_layers` / `decoder_sparse_step` leave dense. Shapes: T tokens, D hidden, E experts,
k experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rackserve.models.moe import Experts, RoutedMoE
from rackserve.models.qwen3_moe.config import ModelConfig


class Gate(nn.Module):
    """Scores experts by a softmax (fp32) over `weight · x` and keeps the k best per token; their
    probabilities, renormalised to sum to 1 with `norm_topk_prob`, weigh the experts' outputs."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.k, self.normalize = config.num_experts_per_tok, config.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[T, D]` -> (expert ids `[T, k]` long, weights `[T, k]` in x's dtype)."""
        logits = F.linear(x, self.weight)
        weights, ids = torch.topk(logits.softmax(dim=-1, dtype=torch.float32), self.k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype)


class SparseMoeBlock(RoutedMoE):
    """The router (`gate`) and the routed experts (`experts`: gate_up `[E, 2I, D]`, gate rows first, as
    transformers fuses `gate_proj` and `up_proj`; down `[E, D, I]`)."""

    def __init__(self, config: ModelConfig):
        super().__init__(config.num_experts, config.num_experts_per_tok)
        self.gate = Gate(config)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)

    def route(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate(x)


class MLP(nn.Module):
    """A dense layer's SwiGLU: down(silu(gate(x)) · up(x)), `[T, D]` -> `[T, D]`."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                real: torch.Tensor | None = None) -> torch.Tensor:
        """Called as a sparse block is (`RoutedMoE.forward`); the ids, positions and padding rows it reads
        go unused."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
