"""What a member of an expert-parallel gang does beside its own work, the same way on every member.

Every step: one host sync (`sync`) so all members run the same number of forward passes (dummy
ones where a DP rank has no work; an expert rank has none of its own), and every `eplb_interval`
gang steps one expert re-placement (`ExpertBalancer`), so all members re-place together.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import numpy as np

from rackserve.model.moe import MoE, rebalance_experts


class Gang(Protocol):
    """The members a rank steps in lockstep with (a `rackserve.collective.Communicator`)."""

    rank: int
    world_size: int

    def allreduce(self, array: np.ndarray, op: str = "sum") -> np.ndarray: ...


def sync(gang: Gang, num_tokens: int, num_passes: int, busy: bool = False) -> tuple[np.ndarray, int, bool]:
    """The gang's host sync: one all-reduce (max) of a `[world_size + 2]` int vector.

    Returns (tokens each member scheduled this step `[world_size]`, the most forward passes any
    member needs, whether any member is `busy` waiting on a transfer). No passes and nobody busy:
    the whole gang is idle."""
    vec = np.zeros(gang.world_size + 2, np.int64)
    vec[gang.rank], vec[-2], vec[-1] = num_tokens, num_passes, busy
    vec = gang.allreduce(vec, "max")
    return vec[:-2], int(vec[-2]), bool(vec[-1])


class ExpertBalancer:
    """EPLB for one member: after every `interval`-th gang step (0: never), re-place the experts of
    `layers` from the load the whole gang counted, and keep the figures for stats."""

    def __init__(self, layers: list[MoE], gang: Gang, interval: int, min_gain: float):
        self.layers, self.gang, self.interval, self.min_gain = layers, gang, interval, min_gain
        self.num_steps = self.num_rebalances = self.moved_slots = 0
        self.history: deque[tuple[float, float]] = deque(maxlen=16)  # balancedness before, after

    def after_step(self) -> None:
        """Count one gang step (one with forward passes); re-place when the interval is due."""
        self.num_steps += 1
        if self.interval and self.num_steps % self.interval == 0:
            done = rebalance_experts(self.layers, lambda a: self.gang.allreduce(a, "sum"), self.min_gain)
            self.num_rebalances += 1
            self.moved_slots += done.moved_slots
            self.history.append((done.balancedness_before, done.balancedness_after))

    def stats(self) -> dict:
        """Rebalances so far, slots moved, and the balancedness of the load each of the last 16
        counted, under the layout it ran on and under the one that replaced it."""
        return {"eplb_rebalances": self.num_rebalances, "eplb_moved_slots": self.moved_slots,
                "eplb_balancedness": [list(pair) for pair in self.history]}
