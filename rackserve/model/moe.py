"""DeepSeek-V4 mixture of experts: learned top-k or hash routing, routed experts, one shared expert.

Routed experts run as two grouped GEMMs over the tokens sorted by expert (no loop over experts).
Shapes: T tokens, D hidden, E routed experts, k experts per token, I expert intermediate size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rackserve.config import HASH_MOE, ModelConfig
from rackserve.kernels import dispatch
from rackserve.kernels.moe import swiglu
from rackserve.placement.eplb import (
    Placement,
    balancedness,
    choose_slots,
    moved_slots,
    rebalance,
)
from rackserve.timing import phase


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
    """Routed experts stored as 3-D tensors: gate_up `[E, 2I, D]`, down `[E, D, I]`, in the model dtype or
    as a published checkpoint stores them (FP8 / FP4 codes plus `*_scale_inv` grids, `model.quantized`)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        e, d, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.limit = config.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.zeros(e, d, i))

    @property
    def quantized(self) -> bool:
        return hasattr(self, "gate_up_proj_scale_inv")

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x `[T, D]`, ids/weights `[T, k]` -> Σ_k weight · expert(x) `[T, D]`."""
        if self.quantized:
            return dispatch.moe_ffn_quantized(x, ids, weights, self.gate_up_proj, self.gate_up_proj_scale_inv,
                                              self.down_proj, self.down_proj_scale_inv, self.limit)
        return dispatch.moe_ffn(x, ids, weights, self.gate_up_proj, self.down_proj, self.limit)

    def rows(self) -> torch.Tensor:
        """Every tensor of each expert as one byte row `[E, bytes]`: what moves when experts move, in
        the stored format (codes and scales as they are)."""
        return torch.cat([t.detach().contiguous().view(torch.uint8).flatten(1) for t in self.parameters()], dim=1)

    def set_rows(self, rows: torch.Tensor) -> None:
        """Hold the experts of byte rows `[E', bytes]` laid out as `rows()` gives them."""
        widths = [t.shape[1:].numel() * t.element_size() for t in self.parameters()]
        for (name, t), part in zip(list(self.named_parameters()), rows.split(widths, dim=1), strict=True):
            value = part.contiguous().view(t.dtype).view(len(rows), *t.shape[1:])
            setattr(self, name, nn.Parameter(value, requires_grad=False))


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

        ep: an expert-parallel transport (`rackserve.transfer.ep.ExpertParallel`: `local_slots`,
        `expert_ranks`, `dispatch`, `combine`, `move_rows`); phy2log `[num_slots]`: this layer's
        logical expert of every physical slot, rank-major (from `rackserve.placement.rebalance`).
        A rank without slots (attention-only, split mode) keeps no experts and only sends tokens.
        On a model still on the meta device (`load_model(..., shard=…)`) only the shapes change, and the
        loader then reads just these experts and calls `set_layout(self.layout)` on the real device.
        """
        rows = self.experts.rows()
        self.experts.set_rows(rows[phy2log[ep.local_slots.start:ep.local_slots.stop].to(rows.device)])
        self.ep = ep
        self.set_layout(phy2log)

    def relayout(self, phy2log: torch.Tensor) -> None:
        """Move to a new slot layout `[num_slots]`: this rank receives the weights of its new slots
        from the ranks that hold them now, as stored. Every rank of the gang must call it at the same time."""
        self.experts.set_rows(self.ep.move_rows(self.phy2log, phy2log.to(self.phy2log.device), self.experts.rows()))
        self.set_layout(phy2log)

    @property
    def local_experts(self) -> list[int]:
        """The logical expert of each of this rank's slots (all experts when not sharded)."""
        if self.ep is None:
            return list(range(self.gate.weight.shape[0]))
        return self.layout[self.ep.local_slots.start:self.ep.local_slots.stop].tolist()

    def set_layout(self, phy2log: torch.Tensor) -> None:
        """The slot maps of a layout (`layout`, on the CPU, and its device buffers), and a fresh count of
        tokens per physical slot `[num_slots]`."""
        self.layout = phy2log.cpu()
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
            with phase("experts"):
                routed = self.experts(x, ids, weights)
        else:
            slots = choose_slots(ids, self.log2phy, self.replica_count, positions)
            self.slot_load += torch.bincount(slots.flatten(), minlength=len(self.slot_load))  # for EPLB
            routed = self._expert_parallel(x, slots, weights)
        return routed + self.shared_experts(x)

    def serve_experts(self) -> None:
        """An expert rank's part of this layer's forward (split mode): it sends no tokens, receives
        the rows bound for its slots, and returns their results. Runs when the attention ranks run
        `forward` on this layer."""
        x = self.gate.weight.new_empty(0, self.gate.weight.shape[1])
        slots = torch.empty(0, self.gate.k, dtype=torch.long, device=x.device)
        self._expert_parallel(x, slots, x.new_empty(0, self.gate.k))

    def _expert_parallel(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x `[T, D]`, slots/weights `[T, k]` -> `[T, D]`: dispatch, this rank's experts, combine."""
        with phase("dispatch/combine"):
            recv, handle = self.ep.dispatch(x, slots, weights)
        with phase("experts"):
            y = self.experts(recv.x, recv.slots[:, None], recv.weights[:, None]) if len(recv.x) else recv.x
        with phase("dispatch/combine"):
            return self.ep.combine(y, handle)


@dataclass
class Rebalance:
    """One EPLB re-placement: slots that changed expert, and the balancedness (mean / max rank
    load, averaged over layers) of the load counted since the last one, under the old and new layout."""

    moved_slots: int
    balancedness_before: float
    balancedness_after: float


def rebalance_experts(layers: list[MoE], reduce_sum: Callable[[np.ndarray], np.ndarray],
                      min_gain: float = 0.0) -> Rebalance:
    """Re-place the routed experts of expert-parallel MoE `layers` (EPLB) from the tokens each
    physical slot served since the last call, summed over the gang by `reduce_sum` (an all-reduce
    of a numpy array), then restart the counts. Every rank of the gang must call it between the same
    two steps; all compute the same layout, and the weights move in one all-to-all per layer."""
    num_experts, ep = layers[0].gate.weight.shape[0], layers[0].ep
    slot_load = torch.as_tensor(reduce_sum(torch.stack([m.slot_load for m in layers]).cpu().numpy()))
    phy2log = torch.stack([m.phy2log for m in layers]).cpu()
    load = torch.zeros(len(layers), num_experts, dtype=torch.float64).scatter_add_(1, phy2log, slot_load.double())
    current = Placement.from_phy2log(phy2log, num_experts)
    ranks = len(ep.expert_ranks)
    new = rebalance(load, num_slots=phy2log.shape[1], num_ranks=ranks, current=current, min_gain=min_gain)
    for m, row in zip(layers, torch.as_tensor(new.phy2log), strict=True):
        m.relayout(row)
    return Rebalance(moved_slots(current, new), balancedness(load, phy2log, ranks),
                     balancedness(load, new.phy2log, ranks))
