"""What a member of an expert-parallel gang does beside its own work, the same way on every member.

Every step: one host sync (`sync`) so all members run the same sequence of MoE exchanges: the same
number of forward passes (dummy ones where a DP rank has no work; an expert rank has none of its
own) and, with speculative decoding, the same number of draft forwards of the MTP layer (dummy ones
where a DP rank has nothing to draft for); and every `eplb_interval` gang steps one expert
re-placement (`ExpertBalancer`), so all members re-place together.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple, Protocol

import numpy as np

from rackserve.model.moe import MoE, rebalance_experts


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


def sync(gang: Gang, num_tokens: int, num_passes: int, num_drafts: int = 0, busy: bool = False) -> GangStep:
    """The gang's host sync: one all-reduce (max) of a `[world_size + 3]` int vector. No passes and
    nobody busy: the whole gang is idle."""
    vec = np.zeros(gang.world_size + 3, np.int64)
    vec[gang.rank], vec[-3], vec[-2], vec[-1] = num_tokens, num_passes, num_drafts, busy
    vec = gang.allreduce(vec, "max")
    return GangStep(vec[:-3], int(vec[-3]), int(vec[-2]), bool(vec[-1]))


class ExpertBalancer:
    """EPLB for one member: after every `interval`-th gang step (0: never), re-place the experts of
    `layers` (the target model's) and of `draft_layers` (the MTP layers'), each set with its own
    layout from its own load (the draft's traffic is not the target's), from the load the whole
    gang counted, and keep the figures for stats."""

    def __init__(self, layers: list[MoE], gang: Gang, interval: int, min_gain: float,
                 draft_layers: list[MoE] = ()):
        self.groups = {"eplb_balancedness": list(layers)}
        if draft_layers:
            self.groups["eplb_draft_balancedness"] = list(draft_layers)
        self.gang, self.interval, self.min_gain = gang, interval, min_gain
        self.num_steps = self.num_rebalances = self.moved_slots = 0
        # per group: (balancedness before, after) of the last 16 re-placements
        self.history = {name: deque(maxlen=16) for name in self.groups}

    def after_step(self) -> None:
        """Count one gang step (one with forward passes); re-place when the interval is due."""
        self.num_steps += 1
        if self.interval and self.num_steps % self.interval == 0:
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
