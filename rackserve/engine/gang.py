"""What a member of an expert-parallel gang does beside its own work, the same way on every member.

Every step: one host sync (`agree`, through `sync`) so all members run the same sequence of MoE exchanges: the same
number of forward passes (dummy ones where a DP rank has no work; an expert rank has none of its
own) and, with speculative decoding, the same number of draft forwards of the MTP layer (dummy ones
where a DP rank has nothing to draft for); and every `eplb_interval` gang steps one expert
re-placement (`ExpertBalancer`), so all members re-place together.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np
import torch

from rackserve.models.moe import RoutedMoE
from rackserve.placement.eplb import Placement, balancedness, moved_slots, rebalance
from rackserve.timing import phase

if TYPE_CHECKING:
    from rackserve.engine.runner import StepPlan


class Gang(Protocol):
    """The members a rank steps in lockstep with (a `rackserve.collective.Communicator`)."""

    rank: int
    world_size: int

    def allreduce(self, array: np.ndarray, op: str = "sum") -> np.ndarray: ...


class GangStep(NamedTuple):
    """What the host sync agreed on for one step."""

    tokens: np.ndarray  # [world_size] tokens each member scheduled
    num_passes: int  # forward passes every member runs (the most any member needs)
    num_drafts: int  # MTP draft forwards every member runs after them (the most any member needs)
    busy: bool  # some member waits on a transfer


def agree(gang: Gang | None, plan: StepPlan) -> StepPlan:
    """The plan every member of `gang` runs this step (`sync`: the most passes and drafts any member
    needs, busy if any member is); outside a gang, `plan` as a gang of one's."""
    if gang is None:
        return replace(plan, gang_tokens=np.array([plan.out.num_tokens], np.int64), gang_busy=plan.busy)
    with phase("host sync"):
        agreed = sync(gang, plan.out.num_tokens, plan.num_passes, plan.num_drafts, plan.busy)
    return replace(plan, num_passes=agreed.num_passes, num_drafts=agreed.num_drafts, busy=agreed.busy,
                   gang_tokens=agreed.tokens, gang_busy=agreed.busy)


def sync(gang: Gang, num_tokens: int, num_passes: int, num_drafts: int = 0, busy: bool = False) -> GangStep:
    """The gang's host sync: one all-reduce (max) of a `[world_size + 3]` int vector. No passes and
    nobody busy: the whole gang is idle."""
    vec = np.zeros(gang.world_size + 3, np.int64)
    vec[gang.rank], vec[-3], vec[-2], vec[-1] = num_tokens, num_passes, num_drafts, busy
    vec = gang.allreduce(vec, "max")
    return GangStep(vec[:-3], int(vec[-3]), int(vec[-2]), bool(vec[-1]))


@dataclass
class Rebalance:
    """One EPLB re-placement: slots that changed expert, and the balancedness (mean / max rank
    load, averaged over layers) of the load counted since the last one, under the old and new layout."""

    moved_slots: int
    balancedness_before: float
    balancedness_after: float


def rebalance_experts(layers: list[RoutedMoE], reduce_sum: Callable[[np.ndarray], np.ndarray],
                      min_gain: float = 0.0) -> Rebalance:
    """Re-place the routed experts of expert-parallel MoE `layers` (EPLB) from the tokens each
    physical slot served since the last call, summed over the gang by `reduce_sum` (an all-reduce
    of a numpy array), then restart the counts. Every rank of the gang must call it between the same
    two steps; all compute the same layout, and the weights move in one all-to-all per layer."""
    num_experts, ep = layers[0].num_experts, layers[0].ep
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


class ExpertBalancer:
    """EPLB for one member: after every `interval`-th gang step (0: never), re-place the experts of
    `layers` (the target model's) and of `draft_layers` (the MTP layers'), each set with its own
    layout from its own load (the draft's traffic is not the target's), from the load the whole
    gang counted, and keep the figures for stats."""

    def __init__(self, layers: list[RoutedMoE], gang: Gang, interval: int, min_gain: float,
                 draft_layers: list[RoutedMoE] = ()):
        self.groups = {"eplb_balancedness": list(layers)}
        # a draft model with fewer experts than a rank's slots has each of them on every rank, and an unsharded one
        # (a gang of one holds every expert) all of them: nothing to move
        draft = draft_layers[0] if draft_layers else None
        if draft is not None and draft.ep is not None and draft.num_experts >= draft.ep.slots_per_rank:
            self.groups["eplb_draft_balancedness"] = list(draft_layers)
        self.gang, self.interval, self.min_gain = gang, interval, min_gain
        self.num_steps = self.num_rebalances = self.moved_slots = 0
        # per group: (balancedness before, after) of the last 16 re-placements
        self.history = {name: deque(maxlen=16) for name in self.groups}

    @property
    def due(self) -> bool:
        """Whether the next `after_step` re-places experts."""
        return bool(self.interval) and (self.num_steps + 1) % self.interval == 0

    def after_step(self, fence: Callable[[], None] | None = None) -> None:
        """Count one gang step (one with forward passes); re-place when the interval is due, after
        `fence` (async scheduling: until the forward thread has run the forwards handed to it)."""
        due = self.due
        self.num_steps += 1
        if due:
            if fence is not None:
                fence()
            for name, layers in self.groups.items():
                done = rebalance_experts(layers, lambda a: self.gang.allreduce(a, "sum"), self.min_gain)
                self.moved_slots += done.moved_slots
                self.history[name].append((done.balancedness_before, done.balancedness_after))
            self.num_rebalances += 1

    def stats(self) -> dict:
        """Rebalances so far, slots moved (all layers), and per group (the target model's; the
        draft's, with MTP layers) the balancedness of the load each of the last 16 counted, under
        the layout it ran on and under the one that replaced it."""
        return {"eplb_rebalances": self.num_rebalances, "eplb_moved_slots": self.moved_slots,
                **{name: [list(pair) for pair in pairs] for name, pairs in self.history.items()}}
