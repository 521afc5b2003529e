"""Simulated expert loads and the real EPLB re-placing experts from them.

Load model (assumed): in every MoE layer, expert popularity is Zipf(`zipf`) over a per-layer
shuffle of the experts (`popularity`, also the EPLB benchmark's model), fixed over time. A forward
pass of T tokens routes T x k token-expert pairs as one multinomial draw over the popularities
(with replacement: a token may pick an expert twice, which changes loads by O(k/E)). A window of
many steps is one draw of all its pairs (a sum of multinomials with the same probabilities is one
multinomial).

`ExpertPlacement` holds the layout in use, starts where `rackserve.cluster.instance.Instance`
starts (`rebalance` of a uniform load), counts the load it served, and every `interval` steps
re-places with `rackserve.placement.eplb.rebalance`, as `rackserve.engine.gang.ExpertBalancer` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rackserve.placement.eplb import Placement, balancedness, rebalance


def popularity(layers: int, experts: int, zipf: float, rng: np.random.Generator) -> np.ndarray:
    """[L, E] log-probabilities: Zipf over a per-layer shuffle of the experts."""
    logp = -zipf * np.log(np.arange(1, experts + 1))
    return np.stack([rng.permutation(logp) for _ in range(layers)])


@dataclass(frozen=True)
class Rebalanced:
    """One re-placement: balancedness (mean / max rank load) of the window it planned from under
    the old layout (`before`), and of the next window under the new one (`after`, out of sample)."""

    step: int
    before: float
    after: float | None = None


class ExpertLoad:
    """Token-expert pairs per expert: `draw(tokens) -> [L, E]` counts for `tokens` tokens per layer."""

    def __init__(self, layers: int, experts: int, topk: int, zipf: float, rng: np.random.Generator):
        logp = popularity(layers, experts, zipf, rng)
        prob = np.exp(logp)
        self.prob = prob / prob.sum(1, keepdims=True)  # [L, E]
        self.topk, self.rng = topk, rng

    def draw(self, tokens: int) -> np.ndarray:
        """[L, E] int64 pairs routed to each expert by `tokens` tokens in every layer."""
        return self.rng.multinomial(int(tokens) * self.topk, self.prob)


class ExpertPlacement:
    """The expert layout of one instance (`num_ranks` ranks, `num_slots` slots per layer) and EPLB."""

    def __init__(self, layers: int, experts: int, num_slots: int, num_ranks: int, interval: int = 0):
        self.experts, self.num_slots, self.num_ranks, self.interval = experts, num_slots, num_ranks, interval
        self.placement = rebalance(np.ones((layers, experts)), num_slots, num_ranks)
        self.window = np.zeros((layers, experts), np.int64)
        self.steps = 0
        self.history: list[Rebalanced] = []

    def rank_loads(self, load: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(pairs `[L, P]` each rank serves, slots `[L, P]` of each rank that serve any) for `load`
        `[L, E]` under the layout in use; an expert's pairs split evenly over its replicas."""
        p2l = np.asarray(self.placement.phy2log)
        count = np.asarray(self.placement.replica_count)
        per_slot = np.take_along_axis(load / count, p2l, 1)  # [L, slots]
        shape = (len(load), self.num_ranks, -1)
        return per_slot.reshape(shape).sum(-1), (per_slot > 0).reshape(shape).sum(-1)

    def balancedness(self, load: np.ndarray) -> float:
        return balancedness(load, self.placement.phy2log, self.num_ranks)

    def after_step(self, load: np.ndarray) -> None:
        """Count a step's load `[L, E]`; re-place when the interval is due (like ExpertBalancer)."""
        self.window += load
        self.steps += 1
        if self.interval and self.steps % self.interval == 0:
            self.replace(self.window)
            self.window = np.zeros_like(self.window)

    def replace(self, load: np.ndarray) -> Placement:
        """Re-place for `load` `[L, E]`; scores the previous re-placement on it (out of sample)."""
        if self.history and self.history[-1].after is None:
            last = self.history[-1]
            self.history[-1] = Rebalanced(last.step, last.before, self.balancedness(load))
        self.history.append(Rebalanced(self.steps, self.balancedness(load)))
        self.placement = rebalance(load, self.num_slots, self.num_ranks, current=self.placement)
        return self.placement


def eplb_trace(load: ExpertLoad, placement: ExpertPlacement, tokens_per_window: int, windows: int) -> list[Rebalanced]:
    """Re-place after each of `windows` windows of `tokens_per_window` tokens (per layer); the
    re-placements, each scored before on its own window and after on the next one."""
    for _ in range(windows):
        placement.replace(load.draw(tokens_per_window))
    return placement.history
