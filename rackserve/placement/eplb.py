"""Expert-parallel load balancing (EPLB): which logical expert each physical expert slot holds.

Every MoE layer has E logical experts and ``num_slots`` physical slots spread evenly over
``num_ranks`` ranks, rank-major: rank r owns slots r*S ... (r+1)*S - 1 with S = num_slots // num_ranks.
The num_slots - E redundant slots hold extra replicas of the busiest experts. ``rebalance`` picks,
from per-layer expert loads, the replica counts and a slot layout that bring the busiest rank's
load as close as possible to the mean.

Load model, used by every function here: an expert's tokens are split evenly over its replicas,
so a rank's load is the sum of load[e] / replica_count[e] over the slots it holds.

The plan follows DeepSeek's EPLB (github.com/deepseek-ai/EPLB): replicas go one at a time to the
expert with the highest load per replica; in hierarchical mode expert groups are first packed onto
nodes so that group-limited routing keeps a token's experts within one node. It differs in how
replicas are packed onto ranks: heaviest first into the least-loaded rank that has room and does
not already hold that expert (physically a second copy on one GPU only wastes memory), then a
local search that lowers the busiest rank by swapping replicas between ranks and by moving a
replica from one expert to another (the per-replica rule balances replicas, not ranks). A previous
layout can be kept or changed as little as possible (``current``, ``min_gain``).
``greedy_reference`` is DeepSeek's global greedy, for comparison. Under the even-split model the
greedy can profit from stacking two replicas of one expert on a rank (a double share); with
realistic token counts the search still matches or beats it, but with very few tokens per slot
(~2k tokens over 256 experts) it can trail it by ~0.05% of balancedness in a few percent of layers.

Every function takes numpy arrays or torch tensors and returns the same kind (torch: int64, CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rackserve.transfer.ep import choose_slots, slot_maps

__all__ = ["Placement", "balancedness", "choose_slots", "greedy_reference", "moved_slots", "rebalance"]

Array = np.ndarray | torch.Tensor

_TIE = 1e-12  # loads within this relative slack, or balancedness within it, count as equal
# Search rounds from the layout in use: rows that match the fresh result mostly do so within
# ~30 rounds; the cap keeps a rebalance with ``current`` within about twice the fresh cost.
_WARM_ROUNDS = 32


@dataclass(frozen=True, eq=False)
class Placement:
    """Where the logical experts of every MoE layer live.

    phy2log:       [L, num_slots] int64, the logical expert held by each physical slot (rank-major).
    log2phy:       [L, E, max_replicas] int64, each logical expert's slots, ascending, -1 padded.
    replica_count: [L, E] int64, how many slots hold each logical expert (>= 1).
    """

    phy2log: Array
    log2phy: Array
    replica_count: Array

    @classmethod
    def from_phy2log(cls, phy2log: Array, num_experts: int) -> Placement:
        """The placement given by phy2log [L, num_slots] (same array kind out)."""
        p2l = _numpy(phy2log).astype(np.int64)
        if p2l.ndim != 2 or p2l.size and (p2l.min() < 0 or p2l.max() >= num_experts):
            raise ValueError(f"phy2log must be [layers, slots] with values in [0, {num_experts}); "
                             f"got shape {tuple(p2l.shape)}")
        count = _bincount_rows(p2l, num_experts)
        if (count == 0).any():
            layer, expert = np.argwhere(count == 0)[0]
            raise ValueError(f"phy2log leaves logical expert {expert} of layer {layer} without a slot; "
                             "every logical expert needs at least one")
        log2phy, count = slot_maps(p2l, num_experts)
        return cls(*(_like(a, phy2log) for a in (p2l, log2phy, count)))


def rebalance(load: Array, num_slots: int, num_ranks: int, num_groups: int | None = None,
              num_nodes: int | None = None, current: Placement | None = None,
              min_gain: float = 0.0) -> Placement:
    """Replicate and place experts so that every rank gets about the same load.

    load:      [L, E] tokens per logical expert per MoE layer (any real dtype, >= 0).
    num_slots: physical slots per layer, >= E and a multiple of num_ranks.
    num_groups, num_nodes: both or neither. Given, the E experts form num_groups contiguous groups
               (as in group-limited routing); whole groups are packed onto nodes (ranks
               k*R/N ... (k+1)*R/N - 1 form node k), then replicated and packed within each node.
               Neither: one global pool.
    current:   the layout in use. It is returned unchanged unless the new layout's balancedness
               on this load is higher by at least min_gain (and by more than nothing). Otherwise,
               among equally balanced layouts, one that moves few slots: the search also starts
               from ``current`` and keeps that result per layer (per node) where it reaches the
               fresh search's peak, then ranks and slots are renumbered to match ``current``.
    Returns a Placement with no logical expert twice on one rank.
    """
    w = _check_load(load)
    layers, experts = w.shape
    groups, nodes = _check_sizes(experts, num_slots, num_ranks, num_groups, num_nodes, distinct=True)
    old = None if current is None else _check_current(current, layers, experts, num_slots)
    ranks_n, slots_n, experts_n = num_ranks // nodes, num_slots // nodes, experts // nodes
    size = experts // groups

    # 1. Whole expert groups onto nodes.
    if nodes == 1:
        node_groups = np.broadcast_to(np.arange(groups), (layers, 1, groups))
    else:
        group_w = w.reshape(layers, groups, size).sum(-1)
        start, ok = (None, None) if old is None else _group_start(old, size, groups, nodes)
        node_groups, _ = _pack(group_w, np.ones_like(group_w, np.int64), None, nodes, start, ok)  # no copies
        if old is not None:
            node_groups = _align_nodes(node_groups, old, size, nodes)
        node_groups = np.sort(node_groups, -1)  # canonical order: same groups, same result below
    # [L*N, E/N] the logical expert behind each node-local expert index
    node_experts = (node_groups[..., None] * size + np.arange(size)).reshape(layers * nodes, experts_n)

    # 2. Replicas within each node; 3. replicas onto the node's ranks.
    w_n = np.take_along_axis(w, node_experts.reshape(layers, experts), 1).reshape(-1, experts_n)
    start, ok = (None, None) if old is None else _replica_start(old, node_experts, ranks_n)
    count = _replicate(w_n, slots_n, ranks_n)  # at most one replica per rank of the node
    layout, _ = _pack(w_n, count, ranks_n, ranks_n, start, ok, rows_per_layer=nodes)
    phy2log = np.take_along_axis(node_experts, layout.reshape(layers * nodes, slots_n), 1)
    phy2log = phy2log.reshape(layers, num_slots)

    if old is not None:
        phy2log = _align_ranks(phy2log, old, num_ranks, nodes)
        gain = balancedness(w, phy2log, num_ranks) - balancedness(w, old, num_ranks)
        if gain < max(min_gain, _TIE):
            return current
    return Placement.from_phy2log(_like(phy2log, load), experts)


def greedy_reference(load: Array, num_slots: int, num_ranks: int) -> Placement:
    """DeepSeek's published global policy, as the baseline ``rebalance`` is measured against.

    load: [L, E]. Replicas go one at a time to the expert with the highest load per replica; then
    replicas, heaviest first, each go to the least-loaded rank with room, with no rule against two
    replicas of one expert on a rank (``balanced_packing`` semantics).
    """
    w = _check_load(load)
    layers, experts = w.shape
    _check_sizes(experts, num_slots, num_ranks, None, None, distinct=False)
    count = _replicate(w, num_slots, None)
    labels = _expand(count)
    content = _lpt(np.take_along_axis(w / count, labels, 1), None, 0, num_ranks)
    phy2log = np.take_along_axis(labels, content.reshape(layers, num_slots), 1)
    return Placement.from_phy2log(_like(phy2log, load), experts)


def balancedness(load: Array, phy2log: Array, num_ranks: int) -> float:
    """Mean over layers of (mean rank load / max rank load); 1.0 is perfect balance.

    load: [L, E] tokens per logical expert; phy2log: [L, num_slots], rank-major. An expert's load is
    split evenly over its replicas; a layer with no load at all counts as balanced.
    """
    w, p2l = _numpy(load).astype(np.float64), _numpy(phy2log).astype(np.int64)
    if p2l.shape[0] != w.shape[0] or p2l.shape[1] % num_ranks:
        raise ValueError(f"phy2log has shape {tuple(p2l.shape)}; expected [{w.shape[0]}, a multiple "
                         f"of num_ranks={num_ranks}] for a load of shape {tuple(w.shape)}")
    rank = _rank_loads(w, p2l, num_ranks)
    peak = rank.max(1)
    return float(np.divide(rank.mean(1), peak, out=np.ones_like(peak), where=peak > 0).mean())


def moved_slots(old: Placement, new: Placement) -> int:
    """How many physical slots (over all layers) hold a different logical expert in ``new``."""
    a, b = _numpy(old.phy2log), _numpy(new.phy2log)
    if a.shape != b.shape:
        raise ValueError(f"placements differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    return int((a != b).sum())


# ---------------------------------------------------------------------------------------------
# Packing. Items are rows of weights [B, m]; a packing is content [B, P, m/P] of item indices.


def _replicate(weight: np.ndarray, num_phy: int, max_count: int | None) -> np.ndarray:
    """Replica counts [B, n] summing to num_phy per row, each at most max_count.

    Giving each next replica to the expert with the highest load per replica minimises the
    largest load per replica (the floor under the busiest rank's load).
    """
    rows = np.arange(weight.shape[0])
    count = np.ones(weight.shape, np.int64)
    for _ in range(num_phy - weight.shape[1]):
        per = weight / count
        if max_count is not None:
            per[count >= max_count] = -np.inf
        count[rows, per.argmax(1)] += 1
    return count


def _expand(count: np.ndarray) -> np.ndarray:
    """[B, m] item labels: label e repeated count[:, e] times, ascending (m = every row's sum)."""
    rows, n = count.shape
    m = int(count[0].sum())
    offset = np.arange(rows)[:, None]
    ends = (np.cumsum(count, 1) + offset * m).ravel()
    return np.searchsorted(ends, np.arange(rows * m), side="right").reshape(rows, m) - offset * n


def _lpt(weight: np.ndarray, labels: np.ndarray | None, num_labels: int, num_packs: int) -> np.ndarray:
    """Heaviest item first into the least-loaded pack with room; with labels, never into a pack
    that already holds the label. weight, labels: [B, m] -> content [B, P, m/P] of item indices."""
    rows_all = np.arange(weight.shape[0])
    size = weight.shape[1] // num_packs
    content = np.full((weight.shape[0], num_packs, size), -1, np.int64)
    fill = np.zeros((weight.shape[0], num_packs), np.int64)
    load = np.zeros((weight.shape[0], num_packs))
    holds = None if labels is None else np.zeros((weight.shape[0], num_packs, num_labels), bool)
    for item in np.argsort(-weight, axis=1, kind="stable").T:
        ok = fill < size
        if holds is not None:
            ok &= ~holds[rows_all, :, labels[rows_all, item]]
        pack = np.where(ok, load, np.inf).argmin(1)
        free = ok.any(1)
        rows, pack, it = rows_all[free], pack[free], item[free]
        content[rows, pack, fill[rows, pack]] = it
        fill[rows, pack] += 1
        load[rows, pack] += weight[rows, it]
        if holds is not None:
            holds[rows, pack, labels[rows, it]] = True
        for b in rows_all[~free]:
            _unstick(b, item[b], content, fill, load, holds, weight, labels)
    return content


def _unstick(b, x, content, fill, load, holds, weight, labels) -> None:
    """Place item x of row b when every pack with room already holds its label (rare, late in LPT).

    Such a pack f has fewer than ``size`` distinct labels, and some full pack g lacks x's label
    (x's label has at most P - 1 placed replicas), so g holds an item y whose label f lacks: move y
    to f and put x in y's place. Of all such moves take the one with the lowest resulting peak.
    """
    lab = labels[b, x]
    size = content.shape[2]
    best = None
    for f in np.flatnonzero(fill[b] < size):
        for g in np.flatnonzero(~holds[b, :, lab]):
            for s, y in enumerate(content[b, g]):
                if not holds[b, f, labels[b, y]]:
                    peak = max(load[b, f] + weight[b, y], load[b, g] - weight[b, y] + weight[b, x])
                    if best is None or peak < best[0]:
                        best = (peak, f, g, s, y)
    _, f, g, s, y = best
    content[b, f, fill[b, f]], content[b, g, s] = y, x
    fill[b, f] += 1
    load[b, f] += weight[b, y]
    load[b, g] += weight[b, x] - weight[b, y]
    holds[b, f, labels[b, y]], holds[b, g, labels[b, y]], holds[b, g, lab] = True, False, True


def _refine(layout: np.ndarray, weight: np.ndarray, count: np.ndarray, cap: int | None,
            target: np.ndarray | None = None, max_rounds: int | None = None):
    """Local search on layouts [B, P, S] of labels, in place (see ``_Refiner``): (layout, count [B, n])."""
    if layout.shape[1] == 1:  # one pack: nothing to move
        return layout, count
    return _Refiner(layout, weight, count, cap).run(target, max_rounds)


class _Refiner:
    """Local search that lowers the busiest pack of layouts [B, P, S] of labels (experts or groups).

    Moves, each leaving every pack it changes below the busiest pack's load and no label twice
    in a pack:
      swap   an item of a heavier pack for a lighter one of another pack. Each round pairs the k-th
             heaviest pack with the k-th lightest and swaps wherever a pair can (many swaps for
             one round's work); a row where no pair can tries the busiest pack against all others.
      shift  when no swap helps the busiest pack, move one replica between labels: a slot of the
             busiest pack takes a replica of the label that costs least there, or a slot elsewhere
             takes one more replica of a label on the busiest pack, which lightens it. Replica
             counts from "highest load per replica first" minimise the heaviest replica, not the
             busiest rank; under heavy skew these moves lower the peak by several percent.
    Every move makes the sorted vector of pack loads lexicographically smaller, so this ends.
    """

    def __init__(self, layout: np.ndarray, weight: np.ndarray, count: np.ndarray, cap: int | None):
        """layout: [B, P, S] label of each slot, changed in place. weight: [B, n] each label's total
        load (tokens). count: [B, n] each label's replicas, each carrying weight / count (copied).
        cap: most replicas per label; None keeps counts fixed (no shifts)."""
        self.layout, self.weight, self.count, self.cap = layout, weight, count.copy(), cap
        rows, self.packs, self.size = layout.shape
        self.holds = np.zeros((rows, self.packs, weight.shape[1]), bool)  # [B, P, n] label is in pack
        self.holds[np.arange(rows)[:, None, None], np.arange(self.packs)[:, None], layout] = True
        self.item_load = np.empty(layout.shape)  # [B, P, S] load carried by each slot's replica
        self.pack_load = np.empty((rows, self.packs))  # [B, P] sum of item_load over the pack
        self._update_loads(np.arange(rows))

    def run(self, target: np.ndarray | None = None, max_rounds: int | None = None):
        """Search until no row's busiest pack has a move left. A row also stops once its peak is at
        most target [B] (starting from the layout in use: fewer moved slots), and all rows after
        max_rounds rounds. Returns (layout [B, P, S], count [B, n])."""
        # Shifts need a label with a replica to spare, so more slots than labels, and free counts.
        shifts = self.cap is not None and self.packs * self.size > self.weight.shape[1]
        rows = np.arange(len(self.layout))
        active = rows if target is None else rows[self.pack_load.max(1) > target]
        rounds = 0
        while active.size and rounds != max_rounds:
            rounds += 1
            stuck = self._swap_pairs(active, target)
            if stuck.size:
                stuck = self._swap_busiest(stuck)
            if stuck.size and shifts:
                stuck = self._shift_busiest(stuck)
            active = np.setdiff1d(active, stuck, assume_unique=True)
            if target is not None:
                active = active[self.pack_load[active].max(1) > target[active]]
        return self.layout, self.count

    def _update_loads(self, rows: np.ndarray) -> None:
        """Recompute item_load and pack_load of rows [n] from their labels and current counts."""
        flat = self.layout[rows].reshape(len(rows), self.packs * self.size)
        per = self.weight[rows] / self.count[rows]
        self.item_load[rows] = np.take_along_axis(per, flat, 1).reshape(len(rows), self.packs, self.size)
        self.pack_load[rows] = self.item_load[rows].sum(-1)

    def _swap_pairs(self, rows: np.ndarray, target: np.ndarray | None) -> np.ndarray:
        """One round on rows [n]: the k-th heaviest pack swaps with the k-th lightest wherever the pair
        can. Returns the rows [m] where no pair could."""
        order = np.argsort(-self.pack_load[rows], axis=1, kind="stable")
        half = self.packs // 2
        heavy, light = order[:, :half], order[:, ::-1][:, :half, None]
        found, partner, slot, partner_slot = self._best_swaps(rows, heavy, light)
        if target is not None:  # packs already at the target need not move
            found &= self.pack_load[rows[:, None], heavy] > target[rows, None]
        n, k = np.nonzero(found)
        self._swap(rows[n], heavy[n, k], partner[n, k], slot[n, k], partner_slot[n, k])
        return rows[~found.any(1)]

    def _swap_busiest(self, rows: np.ndarray) -> np.ndarray:
        """On rows [n] whose pairs were stuck: the busiest pack's best swap with any other pack.
        Returns the rows [m] where it has none."""
        top = self.pack_load[rows].argmax(1)[:, None]
        every = np.broadcast_to(np.arange(self.packs), (len(rows), 1, self.packs))
        found, partner, slot, partner_slot = self._best_swaps(rows, top, every)
        found = found[:, 0]
        self._swap(rows[found], top[found, 0], partner[found, 0], slot[found, 0], partner_slot[found, 0])
        return rows[~found]

    def _best_swaps(self, rows: np.ndarray, heavy: np.ndarray, partners: np.ndarray):
        """Best swap of each heavy pack [n, K] of rows [n] with one of its partner packs [n, K, C]: the
        one with the lowest new peak of the two packs, which must be below the heavy pack's load.
        Returns found [n, K] and, for each, the partner pack and the slots (heavy, partner) to trade."""
        rows2, rows3, rows4 = rows[:, None], rows[:, None, None], rows[:, None, None, None]
        peak = self.pack_load[rows2, heavy][..., None, None, None]
        # [n, K, C, S, S] load moving to the partner when heavy slot i trades with partner slot j
        moved = self.item_load[rows2, heavy][:, :, None, :, None] - self.item_load[rows3, partners][:, :, :, None, :]
        new_peak = np.maximum(peak - moved, self.pack_load[rows3, partners][..., None, None] + moved)
        ok = new_peak < peak * (1 - _TIE)
        # neither pack may already hold the label it receives
        ok &= ~self.holds[rows4, partners[..., None], self.layout[rows2, heavy][:, :, None, :]][..., :, None]
        ok &= ~self.holds[rows4, heavy[:, :, None, None], self.layout[rows3, partners]][..., None, :]
        score = np.where(ok, new_peak, np.inf).reshape(*heavy.shape, -1)
        best = score.argmin(-1)
        found = np.isfinite(np.take_along_axis(score, best[..., None], -1)[..., 0])
        choice, slot, partner_slot = np.unravel_index(best, (partners.shape[-1], self.size, self.size))
        return found, np.take_along_axis(partners, choice[..., None], -1)[..., 0], slot, partner_slot

    def _swap(self, rows, pack, partner, slot, partner_slot) -> None:
        """Trade the items in (pack, slot) and (partner, partner_slot) of rows; all [n], and the packs
        of one row's entries distinct."""
        a, b = (rows, pack, slot), (rows, partner, partner_slot)
        self.pack_load[rows, pack] += self.item_load[b] - self.item_load[a]
        self.pack_load[rows, partner] += self.item_load[a] - self.item_load[b]
        for arr in (self.layout, self.item_load):
            arr[a], arr[b] = arr[b], arr[a].copy()
        # layout is swapped already: slot a now holds the partner's old label
        self.holds[rows, pack, self.layout[b]], self.holds[rows, partner, self.layout[a]] = False, False
        self.holds[rows, pack, self.layout[a]], self.holds[rows, partner, self.layout[b]] = True, True

    def _shift_busiest(self, rows: np.ndarray) -> np.ndarray:
        """On rows [n] where no swap helps: apply the busiest pack's best shift. Returns the rows [m]
        where it has none."""
        found, pack, slot, label = self._best_shift(rows)
        rows, stuck = rows[found], rows[~found]
        pack, slot, label = pack[found], slot[found], label[found]
        old = self.layout[rows, pack, slot]
        self.count[rows, old] -= 1
        self.count[rows, label] += 1
        self.layout[rows, pack, slot] = label
        self.holds[rows, pack, old], self.holds[rows, pack, label] = False, True
        self._update_loads(rows)  # every replica of old and of label changed its load
        return stuck

    def _best_shift(self, rows: np.ndarray):
        """Best shift per row of rows [n], refill or spread (one score list, refills first): found [n],
        and the slot (pack [n], index [n]) that changes label, and its new label [n]."""
        at = np.arange(len(rows))
        top = self.pack_load[rows].argmax(1)
        other, other_load, second_load = self._other_holders(rows, top)
        refill, cheapest = self._refill_peaks(rows, top, other_load)
        spread = self._spread_peaks(rows, top, other, other_load, second_load)
        score = np.concatenate([refill, spread.reshape(len(rows), -1)], 1)
        score[~(score < self.pack_load[rows, top][:, None] * (1 - _TIE))] = np.inf
        best = score.argmin(1)
        found = np.isfinite(score[at, best])
        is_refill = best < self.size
        k = np.maximum(best - self.size, 0)  # spread index: busiest-pack slot i, then slot s of all P*S
        i, s = k // (self.packs * self.size), k % (self.packs * self.size)
        pack = np.where(is_refill, top, s // self.size)
        index = np.where(is_refill, best, s % self.size)
        label = np.where(is_refill, cheapest, self.layout[rows, top, i])
        return found, pack, index, label

    def _replica_loads(self, rows: np.ndarray):
        """Load per replica of each label [n, labels] of rows [n]: now, with one replica more, and how
        much it rises with one replica fewer."""
        weight, count = self.weight[rows], self.count[rows]
        per = weight / count
        return per, weight / (count + 1), weight / np.maximum(count - 1, 1) - per

    def _other_holders(self, rows: np.ndarray, top: np.ndarray):
        """For each label of rows [n], the busiest packs holding it other than the busiest pack top [n]:
        the first one [n, labels], its load, and the second one's load (-inf where there is none)."""
        at = np.arange(len(rows))
        masked = np.where(self.holds[rows], self.pack_load[rows][..., None], -np.inf)  # [n, P, labels]
        masked[at, top] = -np.inf
        first = masked.argmax(1)
        first_load = np.take_along_axis(masked, first[:, None], 1)[:, 0]
        np.put_along_axis(masked, first[:, None], -np.inf, 1)
        return first, first_load, masked.max(1)

    def _refill_peaks(self, rows: np.ndarray, top: np.ndarray, other_load: np.ndarray):
        """Refill: slot i of the busiest pack top [n] gives its label's replica to the label cheapest
        there (not on top, below cap): cheapest [n]. The given-up label's other packs each carry more;
        the busiest of them has load other_load [n, labels]. Returns the new peaks [n, S] (inf where the
        label has no replica to spare) and cheapest."""
        at = np.arange(len(rows))
        per, more, grow = self._replica_loads(rows)
        count, on_top = self.count[rows], self.layout[rows, top]  # on_top: [n, S]
        cost = np.where(self.holds[rows, top] | (count >= self.cap), np.inf, more)
        cheapest = cost.argmin(1)
        peak = self.pack_load[rows, top][:, None]
        new_top = peak - np.take_along_axis(per, on_top, 1) + cost[at, cheapest][:, None]
        peaks = np.maximum(new_top, np.take_along_axis(other_load + grow, on_top, 1))
        peaks[~np.take_along_axis(count > 1, on_top, 1)] = np.inf
        return peaks, cheapest

    def _spread_peaks(self, rows, top, other, other_load, second_load) -> np.ndarray:
        """Spread: label b in slot i of the busiest pack top [n] gains a replica in slot s of another pack
        whose label a gives it up, so the busiest pack sheds part of b's load. Returns the new peaks
        [n, S, P*S] (inf where not allowed); other, other_load, second_load as from ``_other_holders``."""
        at = np.arange(len(rows))
        per, more, grow = self._replica_loads(rows)
        count, held = self.count[rows], self.holds[rows]
        peak, on_top = self.pack_load[rows, top][:, None], self.layout[rows, top]
        slot_label = self.layout[rows].reshape(len(rows), -1)  # [n, P*S] label a of every slot s
        slot_pack = np.arange(self.packs * self.size) // self.size
        a_grow = np.take_along_axis(grow, slot_label, 1)  # [n, P*S]
        shed = np.take_along_axis(per - more, on_top, 1)[:, :, None]  # [n, S, 1]
        top_has_a = np.take_along_axis(held[at, top], slot_label, 1)  # then the busiest pack takes a's rise too
        new_top = peak[..., None] - shed + np.where(top_has_a, a_grow, 0)[:, None, :]
        new_slot = (self.pack_load[rows][:, slot_pack] - np.take_along_axis(per, slot_label, 1))[:, None, :] \
            + np.take_along_axis(more, on_top, 1)[:, :, None]
        # a's busiest pack other than the busiest pack and the slot's own
        a_rest = np.where(np.take_along_axis(other, slot_label, 1) == slot_pack,
                          np.take_along_axis(second_load, slot_label, 1),
                          np.take_along_axis(other_load, slot_label, 1)) + a_grow
        peaks = np.maximum(np.maximum(new_top, new_slot), a_rest[:, None, :])
        allowed = ~held[at[:, None, None], slot_pack, on_top[:, :, None]]  # b not on the slot's pack yet
        allowed &= (np.take_along_axis(count, on_top, 1) < self.cap)[..., None]
        allowed &= np.take_along_axis(count > 1, slot_label, 1)[:, None, :]
        return np.where(allowed, peaks, np.inf)


def _pack(weight, count, cap, num_packs, start=None, start_ok=None, rows_per_layer=1):
    """Layouts [B, P, m/P] of labels and final counts [B, n] for label weights [B, n], from
    initial counts [B, n] (m replicas per row, at most cap per label; None: fixed): LPT over the
    replicas, then local search.

    Rows with a valid start layout [B, P, m/P] (the one in use) also search from there, stopping
    once the layer's fresh peak is matched (a layer spans rows_per_layer consecutive rows, one
    per node, and its peak is theirs), and keep that result if it does: equal quality, far fewer
    moves.
    """
    items = _expand(count)
    content = _lpt(np.take_along_axis(weight / count, items, 1), items, weight.shape[1], num_packs)
    layout = np.take_along_axis(items, content.reshape(len(items), -1), 1).reshape(content.shape)
    layout, count = _refine(layout, weight, count, cap)
    if start is None or not start_ok.any():
        return layout, count
    rows = np.flatnonzero(start_ok)
    peak = _pack_loads(layout, weight / count).max(1).reshape(-1, rows_per_layer).max(1)
    target = np.repeat(peak, rows_per_layer)[rows] * (1 + _TIE)
    start_count = _bincount_rows(start[rows].reshape(len(rows), -1), weight.shape[1])
    warm, warm_count = _refine(start[rows], weight[rows], start_count, cap, target, _WARM_ROUNDS)
    keep = _pack_loads(warm, weight[rows] / warm_count).max(1) <= target
    layout[rows[keep]], count[rows[keep]] = warm[keep], warm_count[keep]
    return layout, count


def _pack_loads(layout: np.ndarray, per: np.ndarray) -> np.ndarray:
    """[B, P] pack loads of layouts [B, P, S] with per-replica weights per [B, n]."""
    return np.take_along_axis(per, layout.reshape(len(layout), -1), 1).reshape(layout.shape).sum(-1)


# ---------------------------------------------------------------------------------------------
# Staying close to the layout in use.


def _group_start(old: np.ndarray, size: int, groups: int, nodes: int):
    """The old layout's groups per node as a layout [L, N, G/N] of group ids, and for which
    layers it is one (each group's replicas all on one node, G/N groups per node)."""
    layers, slots = old.shape
    node = np.broadcast_to(np.arange(slots) // (slots // nodes), old.shape)
    seen = np.zeros((layers, groups, nodes), np.int64)
    np.add.at(seen, (np.arange(layers)[:, None], old // size, node), 1)
    node_of = seen.argmax(-1)  # [L, G]
    ok = ((seen > 0).sum(-1) == 1).all(1) & (_bincount_rows(node_of, nodes) == groups // nodes).all(1)
    start = np.argsort(node_of, axis=1, kind="stable").reshape(layers, nodes, groups // nodes)
    return start, ok


def _align_nodes(node_groups: np.ndarray, old: np.ndarray, size: int, nodes: int) -> np.ndarray:
    """Renumber the nodes of node_groups [L, N, G/N] to overlap the old layout's nodes most."""
    layers, slots = old.shape
    seen = np.zeros((layers, node_groups[0].size, nodes), np.int64)  # old slots per (group, node)
    np.add.at(seen, (np.arange(layers)[:, None], old // size, np.arange(slots) // (slots // nodes)), 1)
    overlap = np.take_along_axis(seen, node_groups.reshape(layers, -1, 1), 1)
    perm = _greedy_match(overlap.reshape(layers, nodes, -1, nodes).sum(2))
    out = np.empty_like(node_groups)
    out[np.arange(layers)[:, None], perm] = node_groups
    return out


def _replica_start(old: np.ndarray, node_experts: np.ndarray, ranks_n: int):
    """The old layout of each node in node-local labels [L*N, R/N, S], and for which rows it is a
    valid start: the node holds the same experts as before, none twice on a rank."""
    rows_n, experts_n = node_experts.shape
    local_of = np.full((rows_n, node_experts.max() + 1), -1, np.int64)
    local_of[np.arange(rows_n)[:, None], node_experts] = np.arange(experts_n)
    start = np.take_along_axis(local_of, old.reshape(rows_n, -1), 1).reshape(rows_n, ranks_n, -1)
    ranked = np.sort(start, -1)
    ok = (start >= 0).all((1, 2)) & ~(ranked[..., 1:] == ranked[..., :-1]).any((1, 2))
    ok &= (_bincount_rows(np.maximum(start, 0).reshape(rows_n, -1), experts_n) > 0).all(1)
    return np.maximum(start, 0), ok


def _align_ranks(phy2log: np.ndarray, old: np.ndarray, num_ranks: int, nodes: int) -> np.ndarray:
    """Renumber ranks to overlap the old ranks most, and order each rank's slots so that experts
    the old rank held keep their slot. phy2log, old: [L, num_slots]."""
    layers, slots = old.shape
    size = slots // num_ranks
    new_r, old_r = phy2log.reshape(-1, num_ranks, size), old.reshape(-1, num_ranks, size)
    rows = np.arange(layers)
    held = np.zeros((layers, num_ranks, int(max(old.max(), phy2log.max())) + 1), bool)
    held[rows[:, None, None], np.arange(num_ranks)[:, None], old_r] = True
    overlap = held[rows[:, None, None], :, new_r].sum(2)  # [L, new rank, old rank]
    # Nodes were aligned already, so ranks may only trade places within their node's block.
    block = np.arange(num_ranks) // (num_ranks // nodes)
    overlap = np.where(block[:, None] == block[None, :], overlap, -1)
    perm = _greedy_match(overlap)
    aligned = np.empty_like(new_r)
    aligned[rows[:, None], perm] = new_r
    # Within a rank: an expert the old rank held takes its old slot, the rest fill the gaps in order.
    new_s, old_s = aligned.reshape(-1, size), old_r.reshape(-1, size)
    eq = new_s[:, :, None] == old_s[:, None, :]
    kept = eq.any(2)
    pos = eq.argmax(2)
    taken = np.zeros(new_s.shape, bool)
    taken[np.nonzero(kept)[0], pos[kept]] = True
    gaps = np.argsort(taken, axis=1, kind="stable")  # untaken slots first, in order
    nth = np.cumsum(~kept, 1) - 1
    target = np.where(kept, pos, np.take_along_axis(gaps, np.maximum(nth, 0), 1))
    out = np.empty_like(new_s)
    np.put_along_axis(out, target, new_s, 1)
    return out.reshape(layers, slots)


def _greedy_match(overlap: np.ndarray) -> np.ndarray:
    """perm [B, n] matching each new index i to an old index perm[:, i], taking the largest
    remaining overlap [B, n, n] first (at least half the optimum; exact when layouts agree)."""
    rows, n = np.arange(overlap.shape[0]), overlap.shape[1]
    overlap = overlap.astype(np.float64)
    perm = np.empty((len(rows), n), np.int64)
    for _ in range(n):
        i, j = np.divmod(overlap.reshape(len(rows), -1).argmax(1), n)
        perm[rows, i] = j
        overlap[rows, i, :] = -np.inf
        overlap[rows, :, j] = -np.inf
    return perm


# ---------------------------------------------------------------------------------------------
# Arrays and argument checks.


def _numpy(x: Array) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _like(a: np.ndarray, ref: Array) -> Array:
    return torch.from_numpy(np.ascontiguousarray(a)) if isinstance(ref, torch.Tensor) else a


def _bincount_rows(x: np.ndarray, n: int) -> np.ndarray:
    """[B, n] occurrences of each value in [0, n) per row of x [B, m]."""
    offset = np.arange(x.shape[0])[:, None] * n
    return np.bincount((x + offset).ravel(), minlength=x.shape[0] * n).reshape(x.shape[0], n)


def _rank_loads(w: np.ndarray, phy2log: np.ndarray, num_ranks: int) -> np.ndarray:
    """[L, R] rank loads under the even-split load model."""
    count = _bincount_rows(phy2log, w.shape[1])
    per = np.take_along_axis(w / np.maximum(count, 1), phy2log, 1)
    return per.reshape(len(w), num_ranks, -1).sum(-1)


def _check_load(load: Array) -> np.ndarray:
    w = _numpy(load).astype(np.float64)
    if w.ndim != 2 or 0 in w.shape:
        raise ValueError(f"load has shape {tuple(w.shape)}; expected [num_layers, num_experts] "
                         "(one row of token counts per MoE layer)")
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError("load has negative or non-finite entries; pass token counts >= 0")
    return w


def _check_sizes(experts, num_slots, num_ranks, num_groups, num_nodes, distinct) -> tuple[int, int]:
    """(groups, nodes) after checking the sizes fit; (1, 1) for the global policy."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks={num_ranks}; need at least one rank")
    if num_slots < experts:
        raise ValueError(f"num_slots={num_slots} is fewer than the {experts} logical experts; every "
                         f"expert needs a slot: pass num_slots >= {experts}")
    if num_slots % num_ranks:
        fit = -(-num_slots // num_ranks) * num_ranks
        raise ValueError(f"num_slots={num_slots} is not divisible by num_ranks={num_ranks}; every rank "
                         f"holds the same number of slots: pass a multiple of {num_ranks} (e.g. {fit})")
    if (num_groups is None) != (num_nodes is None):
        raise ValueError(f"num_groups={num_groups}, num_nodes={num_nodes}: pass both for hierarchical "
                         "balancing (groups packed onto nodes) or neither for one global pool")
    groups, nodes = (1, 1) if num_groups is None else (num_groups, num_nodes)
    if groups < 1 or experts % groups:
        raise ValueError(f"num_groups={groups} does not divide the {experts} experts into equal groups; "
                         "pass the model's number of expert groups")
    if nodes < 1 or groups % nodes:
        raise ValueError(f"num_groups={groups} is not divisible by num_nodes={nodes}; every node takes "
                         "whole groups, as many as any other: pick num_nodes dividing num_groups")
    if num_ranks % nodes:
        raise ValueError(f"num_ranks={num_ranks} is not divisible by num_nodes={nodes}; every node "
                         "must have the same number of ranks")
    if distinct and num_slots // num_ranks > experts // nodes:
        raise ValueError(f"{num_slots // num_ranks} slots per rank exceed the {experts // nodes} experts "
                         "a rank can choose from, and a rank holds each expert at most once: "
                         "lower num_slots or raise num_ranks")
    return groups, nodes


def _check_current(current: Placement, layers: int, experts: int, num_slots: int) -> np.ndarray:
    old = _numpy(current.phy2log).astype(np.int64)
    if old.shape != (layers, num_slots) or old.min() < 0 or old.max() >= experts:
        raise ValueError(f"current.phy2log has shape {tuple(old.shape)}; expected [{layers}, {num_slots}] "
                         f"with experts in [0, {experts}) to match this load and num_slots")
    return old
