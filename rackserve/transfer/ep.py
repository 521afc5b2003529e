"""Expert-parallel transport: send each token to the ranks that hold its experts, bring results back.

A DeepEP-shaped pair over `torch.distributed` all-to-all (Gloo on CPU, NCCL on CUDA):

    recv, handle = ep.dispatch(x, slots, weights)     # on every rank, same step, same layer
    y = local_experts(recv.x, recv.slots, recv.weights)  # rows for this rank's physical slots
    out = ep.combine(y, handle)                        # [T, D]: Σ_k weight · expert(x) per token

Physical slots are laid out rank-major over the ranks that hold experts, `expert_ranks` of the
group (all of it in DEP mode; the expert ranks after the attention ranks in attention–FFN split
mode): the j-th of them holds slots `j·S … j·S + S - 1` (S slots per rank); other ranks hold none
and only send tokens.
Which replica of a logical expert a token uses: `choose_slots`, over the maps `slot_maps` derives from
a layer's layout (EPLB, `rackserve.placement.eplb`, decides the layout).
One row travels per (token, expert) pair; deduplicating pairs bound for the same rank (as DeepEP
does) is a bandwidth optimisation for later.
Shapes: T tokens on this rank, k experts per token, D hidden, N rows received.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


def slot_maps(phy2log: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Layouts phy2log `[L, S]` int64 (the logical expert of each physical slot, every expert held) ->
    (log2phy `[L, E, R]`: each expert's slots, ascending, -1 padded; replica_count `[L, E]`)."""
    layers, slots = phy2log.shape
    offset = np.arange(layers)[:, None] * num_experts
    count = np.bincount((phy2log + offset).ravel(), minlength=layers * num_experts).reshape(layers, num_experts)
    order = np.argsort(phy2log, axis=1, kind="stable")  # slots grouped by expert, ascending
    expert = np.take_along_axis(phy2log, order, 1)
    first = np.cumsum(count, 1) - count
    replica = np.arange(slots) - np.take_along_axis(first, expert, 1)
    log2phy = np.full((layers, num_experts, count.max()), -1, np.int64)
    log2phy[np.arange(layers)[:, None], expert, replica] = order
    return log2phy, count


def choose_slots(ids: torch.Tensor, log2phy: torch.Tensor, replica_count: torch.Tensor,
                 token_index: torch.Tensor) -> torch.Tensor:
    """Physical slot of each (token, expert) pair of one layer; replicas are used round-robin by token.

    ids `[T, k]` logical experts; log2phy `[E, R]` (-1 padded); replica_count `[E]`; token_index `[T]`
    any per-token counter (e.g. positions) that spreads tokens over replicas -> slots `[T, k]`.
    """
    replica = token_index[:, None] % replica_count[ids]
    return log2phy[ids, replica]


@dataclass
class Received:
    """What a rank receives to compute: rows `x [N, D]`, their local slot `[N]` and weight `[N]`."""

    x: torch.Tensor
    slots: torch.Tensor
    weights: torch.Tensor


@dataclass
class DispatchHandle:
    """How to bring results back: the send permutation and the per-rank row counts both ways."""

    order: torch.Tensor  # [T·k] pair index of each sent row, grouped by destination rank
    send_counts: list[int]
    recv_counts: list[int]
    num_tokens: int
    k: int


class ExpertParallel:
    """The dispatch/combine pair for one process group whose `expert_ranks` (default: every rank)
    hold `slots_per_rank` slots each."""

    def __init__(self, slots_per_rank: int, group: dist.ProcessGroup | None = None,
                 expert_ranks: range | None = None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.slots_per_rank = slots_per_rank
        self.expert_ranks = expert_ranks if expert_ranks is not None else range(self.world)
        if not (0 <= self.expert_ranks.start < self.expert_ranks.stop <= self.world and self.expert_ranks.step == 1):
            raise ValueError(f"expert_ranks={self.expert_ranks} must be a non-empty run of ranks in [0, {self.world})")
        self.local_slots = range(0)  # the physical slots this rank holds
        if self.rank in self.expert_ranks:
            first = (self.rank - self.expert_ranks.start) * slots_per_rank
            self.local_slots = range(first, first + slots_per_rank)

    @property
    def num_slots(self) -> int:
        return len(self.expert_ranks) * self.slots_per_rank

    def owner(self, slots: torch.Tensor) -> torch.Tensor:
        """The group rank holding each physical slot (same shape as `slots`)."""
        return self.expert_ranks.start + slots // self.slots_per_rank

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None = None,
                    in_splits: list[int] | None = None) -> None:
        """`dist.all_to_all_single` into `out`; a group of one rank just copies (no transport)."""
        if self.world == 1:
            out.copy_(inp)
        else:
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)

    def _exchange_counts(self, send_counts: torch.Tensor) -> list[int]:
        recv = torch.empty_like(send_counts)
        self._all_to_all(recv, send_counts)
        return recv.tolist()

    def dispatch(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> tuple[Received, DispatchHandle]:
        """x `[T, D]`, slots/weights `[T, k]` (global physical slots) -> rows for this rank's slots."""
        t, k = slots.shape
        flat = slots.flatten()
        dest = self.owner(flat)
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=self.world)
        recv_counts = self._exchange_counts(send_counts)
        send_counts = send_counts.tolist()
        n = sum(recv_counts)
        token = order // k
        recv_x = x.new_empty(n, x.shape[1])
        self._all_to_all(recv_x, x[token].contiguous(), recv_counts, send_counts)
        # slot ids and weights travel together as one fp64 tensor (exact for both) to save a round
        meta = torch.stack([flat[order].double(), weights.flatten()[order].double()], dim=1)
        recv_meta = meta.new_empty(n, 2)
        self._all_to_all(recv_meta, meta, recv_counts, send_counts)
        local = recv_meta[:, 0].long() - self.local_slots.start
        received = Received(recv_x, local, recv_meta[:, 1].to(weights.dtype))
        return received, DispatchHandle(order, send_counts, recv_counts, t, k)

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """y `[N, D]` (already weighted) -> `[T, D]`, the sum over each token's k pairs."""
        back = y.new_empty(len(handle.order), y.shape[1])
        self._all_to_all(back, y.contiguous(), handle.send_counts, handle.recv_counts)
        out = torch.zeros(handle.num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
        out.index_add_(0, handle.order // handle.k, back.float())
        return out.to(y.dtype)

    def move_rows(self, old: torch.Tensor, new: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Re-lay per-slot rows (expert weights) from layout `old` to layout `new` (`[num_slots]`
        logical expert per physical slot, the same on every rank).

        rows `[len(local_slots), R]`: this rank's rows under `old` -> its rows under `new`. Each new
        slot gets its expert from the first old slot holding it; one all-to-all moves every row.
        """
        first: dict[int, int] = {}
        for slot, expert in enumerate(old.tolist()):
            first.setdefault(expert, slot)
        missing = sorted(set(new.tolist()) - set(first))
        if missing:
            raise ValueError(f"the new layout holds experts {missing} that no slot holds now")
        mine = self.local_slots
        src = torch.tensor([first[e] for e in new.tolist()])  # [num_slots] source slot of each new slot
        src_rank, dst_rank = self.owner(src), self.owner(torch.arange(len(new)))
        # rows leave in new-slot order, so each destination gets its rows ascending by slot
        outgoing = (src_rank == self.rank).nonzero().squeeze(1)
        send = rows[(src[outgoing] - mine.start).to(rows.device)]
        send_counts = torch.bincount(dst_rank[outgoing], minlength=self.world).tolist()
        incoming = torch.arange(mine.start, mine.stop)
        order = torch.argsort(src_rank[incoming], stable=True)  # grouped by source, ascending slot
        recv_counts = torch.bincount(src_rank[incoming], minlength=self.world).tolist()
        recv = rows.new_empty(len(mine), rows.shape[1])
        self._all_to_all(recv, send.contiguous(), recv_counts, send_counts)
        out = torch.empty_like(recv)
        out[order.to(rows.device)] = recv
        return out
