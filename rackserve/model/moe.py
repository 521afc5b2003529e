"""DeepSeek-V4 mixture of experts: learned top-k or hash routing, routed experts, one shared expert.

Routed experts run as two grouped GEMMs over the tokens sorted by expert (no loop over experts).
Shapes: T tokens, D hidden, E routed experts, k experts per token, I expert intermediate size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rackserve.config import HASH_MOE, ModelConfig
from rackserve.kernels import dispatch
from rackserve.kernels.moe import swiglu
from rackserve.placement.eplb import Placement, choose_slots


class Router(nn.Module):
    """Scores experts and picks k per token: by score + correction bias, or by a frozen hash table.

    Either way the weights are the picked experts' scores, renormalised to sum to 1 and scaled
    by `routed_scaling_factor`.
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
        logits = F.linear(x, self.weight)
        if self.hashed:
            return dispatch.route(logits, self.k, self.scoring, self.scale, hash_ids=self.tid2eid[input_ids])
        return dispatch.route(logits, self.k, self.scoring, self.scale, bias=self.e_score_correction_bias)


class Experts(nn.Module):
    """Routed experts stored as 3-D tensors: gate_up `[E, 2I, D]`, down `[E, D, I]`."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        e, d, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.limit = config.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.zeros(e, d, i))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x `[T, D]`, ids/weights `[T, k]` -> Σ_k weight · expert(x) `[T, D]`."""
        return dispatch.moe_ffn(x, ids, weights, self.gate_up_proj, self.down_proj, self.limit)


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


class MoE(nn.Module):
    """Router, routed experts and the shared expert. With `shard`, the routed experts are this rank's
    physical slots only and tokens travel to the ranks that hold their experts (expert parallel)."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.gate = Router(config, hashed=config.mlp_layer_types[layer] == HASH_MOE)
        self.experts = Experts(config)
        self.shared_experts = SharedExpert(config)
        self.ep = None

    def shard(self, ep, phy2log: torch.Tensor) -> None:
        """Keep only the experts of this rank's physical slots and route through `ep`.

        ep: an expert-parallel transport (`rackserve.transfer.ep.ExpertParallel`: `rank`,
        `slots_per_rank`, `dispatch`, `combine`, `move_rows`); phy2log `[num_slots]`: this layer's
        logical expert of every physical slot, rank-major (from `rackserve.placement.rebalance`).
        """
        mine = phy2log[ep.rank * ep.slots_per_rank:(ep.rank + 1) * ep.slots_per_rank].to(self.gate.weight.device)
        self._set_experts(self.experts.gate_up_proj.data[mine], self.experts.down_proj.data[mine])
        self.ep = ep
        self._set_layout(phy2log)

    def relayout(self, phy2log: torch.Tensor) -> None:
        """Move to a new slot layout `[num_slots]`: this rank receives the weights of its new slots
        from the ranks that hold them now. Every rank of the gang must call it at the same time."""
        experts = self.experts
        rows = torch.cat([experts.gate_up_proj.flatten(1), experts.down_proj.flatten(1)], dim=1)
        rows = self.ep.move_rows(self.phy2log, phy2log.to(self.phy2log.device), rows)
        gate_up, down = rows.split([experts.gate_up_proj[0].numel(), experts.down_proj[0].numel()], dim=1)
        self._set_experts(gate_up.view_as(experts.gate_up_proj), down.view_as(experts.down_proj))
        self._set_layout(phy2log)

    def _set_experts(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self.experts.gate_up_proj = nn.Parameter(gate_up.clone(), requires_grad=False)
        self.experts.down_proj = nn.Parameter(down.clone(), requires_grad=False)

    def _set_layout(self, phy2log: torch.Tensor) -> None:
        """The slot maps of a layout, and a fresh count of tokens per physical slot `[num_slots]`."""
        device = self.gate.weight.device
        placement = Placement.from_phy2log(phy2log[None].cpu(), self.gate.weight.shape[0])
        self.register_buffer("phy2log", phy2log.to(device), persistent=False)
        self.register_buffer("log2phy", torch.as_tensor(placement.log2phy)[0].to(device), persistent=False)
        self.register_buffer("replica_count", torch.as_tensor(placement.replica_count)[0].to(device),
                             persistent=False)
        self.register_buffer("slot_load", torch.zeros(len(phy2log), dtype=torch.int64, device=device),
                             persistent=False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x `[T, D]`, input_ids `[T]` (hash routing reads them), positions `[T]` -> `[T, D]`."""
        ids, weights = self.gate(x, input_ids)
        if self.ep is None:
            routed = self.experts(x, ids, weights)
        else:
            slots = choose_slots(ids, self.log2phy, self.replica_count, positions)
            self.slot_load += torch.bincount(slots.flatten(), minlength=len(self.slot_load))  # for EPLB
            recv, handle = self.ep.dispatch(x, slots, weights)
            routed = self.ep.combine(self.experts(recv.x, recv.slots[:, None], recv.weights[:, None]), handle)
        return routed + self.shared_experts(x)
