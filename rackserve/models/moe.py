"""Routed experts with expert parallelism, for any model family's MoE block.

A family's MoE block subclasses `RoutedMoE` and says how tokens pick experts (`route`) and what runs
beside the routed experts (`shared`, e.g. DeepSeek-V4's shared expert); the rest is common: the
experts as two grouped GEMMs over the tokens sorted by expert (no loop over experts), and, once
`shard`ed, expert parallelism: this rank keeps only its physical slots, tokens travel to the ranks
holding their experts (`rackserve.transfer.ep`), tokens per slot are counted for EPLB, and
`relayout` moves experts between ranks as stored.
Shapes: T tokens, D hidden, E routed experts, k experts per token, I expert intermediate size.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from rackserve.kernels import dispatch
from rackserve.timing import phase
from rackserve.transfer.ep import choose_slots, slot_maps


class Experts(nn.Module):
    """Routed experts stored as 3-D tensors: gate_up `[E, 2I, D]`, down `[E, D, I]`, in the model dtype or
    as a published checkpoint stores them (FP8 / FP4 codes plus `*_scale_inv` grids, `quantized`).
    `limit`: SwiGLU clamp (inf: none)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, limit: float = float("inf")):
        super().__init__()
        self.limit = limit
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden_size, intermediate_size))

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

    def select(self, experts: torch.Tensor) -> None:
        """Hold only experts `experts` `[E']` (indices into those held now, repeats allowed), in that order.
        On the meta device only the shapes change: copying rows there would run torch's reference ops, whose
        first call imports dynamo (1.3 s of each process's start), for no data."""
        if next(self.parameters()).is_meta:
            for name, t in list(self.named_parameters()):
                setattr(self, name, nn.Parameter(t.new_empty(len(experts), *t.shape[1:]), requires_grad=False))
            return
        rows = self.rows()
        self.set_rows(rows[experts.to(rows.device)])

    def set_rows(self, rows: torch.Tensor) -> None:
        """Hold the experts of byte rows `[E', bytes]` laid out as `rows()` gives them."""
        widths = [t.shape[1:].numel() * t.element_size() for t in self.parameters()]
        for (name, t), part in zip(list(self.named_parameters()), rows.split(widths, dim=1), strict=True):
            value = part.contiguous().view(t.dtype).view(len(rows), *t.shape[1:])
            if value.shape == t.shape and value.device == t.device:
                t.data.copy_(value)  # in place (an EPLB move): compiled forwards keep their inputs
            else:
                setattr(self, name, nn.Parameter(value, requires_grad=False))


class RoutedMoE(nn.Module):
    """A MoE block: `route` picks k of `num_experts` experts per token, `experts` (an `Experts`) computes
    them, `shared` adds what runs for every token. With `shard`, the routed experts are this rank's
    physical slots only and tokens travel to the ranks that hold their experts (expert parallel)."""

    def __init__(self, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.ep = None

    def route(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[T, D]`, input_ids `[T]` -> (expert ids `[T, k]` long, weights `[T, k]`)."""
        raise NotImplementedError

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        """What every token gets besides its routed experts `[T, D]` (None: nothing)."""
        return None

    @property
    def _anchor(self) -> torch.Tensor:
        """A parameter that stays where the block runs (the routed experts may be sharded away)."""
        return next(p for name, p in self.named_parameters() if not name.startswith("experts."))

    def shard(self, ep, phy2log: torch.Tensor) -> None:
        """Keep only the experts of this rank's physical slots and route through `ep`.

        ep: an expert-parallel transport (`rackserve.transfer.ep.ExpertParallel`: `local_slots`,
        `expert_ranks`, `dispatch`, `combine`, `move_rows`); phy2log `[num_slots]`: this layer's
        logical expert of every physical slot, rank-major (from `rackserve.placement.rebalance`).
        A rank without slots (attention-only, split mode) keeps no experts and only sends tokens.
        On a model still on the meta device (`load_model(..., shard=…)`) only the shapes change, and the
        loader then reads just these experts and calls `set_layout(self.layout)` on the real device.
        """
        self.experts.select(phy2log[ep.local_slots.start:ep.local_slots.stop])
        self.ep = ep
        _SHARDED[id(self)] = self
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
            return list(range(self.num_experts))
        return self.layout[self.ep.local_slots.start:self.ep.local_slots.stop].tolist()

    def set_layout(self, phy2log: torch.Tensor) -> None:
        """The slot maps of a layout (`layout`, on the CPU, and its device buffers), and a fresh count of
        tokens per physical slot `[num_slots]`."""
        self.layout = phy2log.cpu()
        device = self._anchor.device
        log2phy, replica_count = slot_maps(self.layout[None].long().numpy(), self.num_experts)
        maps = {"phy2log": phy2log.to(device), "log2phy": torch.from_numpy(log2phy[0]).to(device),
                "replica_count": torch.from_numpy(replica_count[0]).to(device),
                "slot_load": torch.zeros(len(phy2log), dtype=torch.int64, device=device)}
        for name, value in maps.items():
            old = self._buffers.get(name)
            if old is not None and old.shape == value.shape and old.dtype == value.dtype:
                old.copy_(value)  # in place: compiled forwards keep their inputs (and their guards hold)
            else:
                self.register_buffer(name, value, persistent=False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                real: torch.Tensor | None = None) -> torch.Tensor:
        """x `[T, D]`, input_ids `[T]` (hash routing reads them), positions `[T]`, real `[T]` bool (False:
        a padding row of a fixed-shape batch; None: all real) -> `[T, D]`."""
        ids, weights = self.route(x, input_ids)
        if self.ep is None:
            with phase("experts"):
                routed = self.experts(x, ids, weights)
        elif torch.compiler.is_compiling():
            routed = _expert_parallel_op(x, ids, weights, positions, real, id(self))
        else:
            routed = self._expert_parallel(x, ids, weights, positions, real)
        shared = self.shared(x)
        return routed if shared is None else routed + shared

    def serve_experts(self) -> None:
        """An expert rank's part of this layer's forward (split mode): it sends no tokens, receives
        the rows bound for its slots, and returns their results. Runs when the attention ranks run
        `forward` on this layer."""
        anchor = self._anchor
        x = anchor.new_empty(0, self.experts.down_proj.shape[1])
        self._exchange(x, torch.empty(0, self.top_k, dtype=torch.long, device=x.device), x.new_empty(0, self.top_k))

    def _expert_parallel(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor,
                         real: torch.Tensor | None) -> torch.Tensor:
        """x `[T, D]`, ids/weights `[T, k]` -> `[T, D]`: the physical slots, counted for EPLB, then the
        exchange; padding rows (`real` False) neither travel nor count, and get zeros."""
        keep = None if real is None or bool(real.all()) else real.nonzero().squeeze(1)
        if keep is not None:
            x, ids, weights, positions = x[keep], ids[keep], weights[keep], positions[keep]
        slots = choose_slots(ids, self.log2phy, self.replica_count, positions)
        self.slot_load += torch.bincount(slots.flatten(), minlength=len(self.slot_load))  # for EPLB
        routed = self._exchange(x, slots, weights)
        if keep is None:
            return routed
        return routed.new_zeros(len(real), routed.shape[1]).index_copy_(0, keep, routed)

    def _exchange(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x `[T, D]`, slots/weights `[T, k]` -> `[T, D]`: dispatch, this rank's experts, combine."""
        with phase("dispatch/combine"):
            recv, handle = self.ep.dispatch(x, slots, weights)
        with phase("experts"):
            y = self.experts(recv.x, recv.slots[:, None], recv.weights[:, None]) if len(recv.x) else recv.x
        with phase("dispatch/combine"):
            return self.ep.combine(y, handle)


# A compiled forward calls a sharded layer's exchange as one opaque op (its output has its input's shape),
# so a DP rank's forward stays one graph: the exchange is host-driven (row counts travel first) and
# cannot be traced. The op finds its layer by id: custom ops take tensors and numbers only.
_SHARDED: weakref.WeakValueDictionary[int, RoutedMoE] = weakref.WeakValueDictionary()


@torch.library.custom_op("rackserve::expert_parallel", mutates_args=())
def _expert_parallel_op(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor,
                        real: torch.Tensor | None, layer: int) -> torch.Tensor:
    return _SHARDED[layer]._expert_parallel(x, ids, weights, positions, real)


@_expert_parallel_op.register_fake
def _(x, ids, weights, positions, real, layer):
    return torch.empty_like(x)
