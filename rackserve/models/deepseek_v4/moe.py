"""DeepSeek-V4 mixture of experts: learned top-k or hash routing, routed experts (`rackserve.models.moe`,
with expert parallelism), one shared expert. Shapes: T tokens, D hidden, k experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rackserve.kernels import dispatch
from rackserve.kernels.moe import swiglu
from rackserve.models.deepseek_v4.config import HASH_MOE, ModelConfig
from rackserve.models.moe import Experts, RoutedMoE


class Gate(nn.Module):
    """Scores experts and picks k per token: by score + correction bias, or by a frozen hash table.

    Either way the weights are the picked experts' scores, renormalised to sum to 1 and scaled
    by `routed_scaling_factor`. The scores are computed in the router weight's dtype (DeepSeek-V4.1
    keeps it in fp32).
    """

    def __init__(self, config: ModelConfig, hashed: bool):
        super().__init__()
        self.k, self.hashed = config.num_experts_per_tok, hashed
        self.scoring, self.scale = config.scoring_func, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[T, D]`, input_ids `[T]` -> (expert ids `[T, k]` long, weights `[T, k]`)."""
        logits = F.linear(x.to(self.weight.dtype), self.weight)
        if self.hashed:
            return dispatch.route(logits, self.k, self.scoring, self.scale, hash_ids=self.tid2eid[input_ids])
        return dispatch.route(logits, self.k, self.scoring, self.scale, bias=self.e_score_correction_bias)


class SharedExpert(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        d, i = config.hidden_size, config.moe_intermediate_size
        self.limit = config.swiglu_limit
        self.gate_proj = nn.Linear(d, i, bias=False)
        self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class MoE(RoutedMoE):
    """Gate (learned top-k or hash), routed experts and the shared expert."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__(config.n_routed_experts, config.num_experts_per_tok)
        self.gate = Gate(config, hashed=config.mlp_layer_types[layer] == HASH_MOE)
        self.experts = Experts(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size,
                               config.swiglu_limit)
        self.shared_experts = SharedExpert(config)

    def route(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate(x, input_ids)

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared_experts(x)
