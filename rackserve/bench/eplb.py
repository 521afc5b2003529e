"""Expert placement (EPLB) on Zipf-skewed expert loads: balancedness and time per call.

    python -m rackserve.bench.eplb [--layers 43] [--experts 256] [--tokens 8192] [--topk 6]
                                   [--zipf 1.0] [--repeats 5] [--seed 0]

Loads: in every layer each of ``tokens`` tokens picks ``topk`` distinct experts, drawn without
replacement (Gumbel top-k) from Zipf(``zipf``) popularities over experts shuffled per layer.
Layouts, scored on the same loads by balancedness (mean / max rank load, averaged over layers;
an expert's tokens split evenly over its replicas):

  none    no balancing: expert e in slot e; redundant slots, if any, hold second replicas of
          experts 0..R-1, i.e. redundancy that ignores the load
  greedy  DeepSeek's published global greedy (``greedy_reference``; our vectorised version)
  ours    ``rebalance``, global
  hier    ``rebalance``, hierarchical: 8 expert groups packed onto ranks/8 nodes

Times are medians over ``repeats`` calls on this CPU. 64 ranks skip 288 slots (not a multiple of
64). Then drift: re-balance on a fresh token sample with the same popularities, with and without
``current``, and count the moved slots. The last line is one JSON object with the headline figures.
"""

from __future__ import annotations

import time
from functools import partial

import numpy as np

from rackserve.bench import script
from rackserve.placement.eplb import balancedness, greedy_reference, moved_slots, rebalance
from rackserve.sim.experts import popularity

CONFIGS = [(32, 256), (32, 288), (32, 320), (64, 256), (64, 320)]  # (ranks, slots)
GROUPS, RANKS_PER_NODE = 8, 8


def sample_load(logp: np.ndarray, tokens: int, topk: int, rng: np.random.Generator) -> np.ndarray:
    """[L, E] token counts: each token's top-k distinct experts by Gumbel-perturbed log-probability."""
    load = np.zeros(logp.shape, np.int64)
    for layer, row in enumerate(logp):
        keys = row + rng.gumbel(size=(tokens, len(row)))
        picked = np.argpartition(-keys, topk - 1, axis=1)[:, :topk]
        load[layer] = np.bincount(picked.ravel(), minlength=len(row))
    return load


def no_balancing(layers: int, experts: int, slots: int) -> np.ndarray:
    """[L, slots] identity layout; the redundant slots copy experts 0..slots-E-1."""
    return np.tile(np.arange(slots) % experts, (layers, 1))


def timed(call, repeats: int):
    """(result, median milliseconds) of ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = call()
        times.append((time.perf_counter() - start) * 1e3)
    return result, float(np.median(times))


def main(argv: list[str] | None = None) -> dict:
    parser = script.parser(__doc__)
    parser.add_argument("--layers", type=int, default=43)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--topk", type=int, default=6)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    logp = popularity(args.layers, args.experts, args.zipf, rng)
    load = sample_load(logp, args.tokens, args.topk, rng)
    summary = {"bench": "eplb", "layers": args.layers, "experts": args.experts, "zipf": args.zipf}
    print(f"{args.layers} layers, {args.experts} experts, {args.tokens} tokens x top-{args.topk}, "
          f"Zipf {args.zipf}; balancedness = mean/max rank load (1 = perfect); ms = median of "
          f"{args.repeats}")
    print(f"{'ranks':>5} {'slots':>5} {'extra':>5} | {'none':>6} {'greedy':>6} {'ours':>6} {'hier':>6} "
          f"| {'greedy ms':>9} {'ours ms':>8} {'hier ms':>8}")
    for ranks, slots in CONFIGS:
        nodes = ranks // RANKS_PER_NODE
        none = balancedness(load, no_balancing(args.layers, args.experts, slots), ranks)
        greedy, greedy_ms = timed(partial(greedy_reference, load, slots, ranks), args.repeats)
        ours, ours_ms = timed(partial(rebalance, load, slots, ranks), args.repeats)
        hier, hier_ms = timed(partial(rebalance, load, slots, ranks, GROUPS, nodes), args.repeats)
        scores = [none] + [balancedness(load, p.phy2log, ranks) for p in (greedy, ours, hier)]
        print(f"{ranks:>5} {slots:>5} {slots - args.experts:>5} | "
              + " ".join(f"{s:>6.4f}" for s in scores)
              + f" | {greedy_ms:>9.1f} {ours_ms:>8.1f} {hier_ms:>8.1f}")
        key = f"r{ranks}_s{slots}"
        names = ("none", "greedy", "ours", "hier")
        summary.update({f"{key}_{name}": round(s, 4) for name, s in zip(names, scores)})
        summary.update({f"{key}_greedy_ms": round(greedy_ms, 1), f"{key}_ours_ms": round(ours_ms, 1),
                        f"{key}_hier_ms": round(hier_ms, 1)})

    # Drift: the next window's tokens, same popularities. Moved slots out of layers x slots.
    later = sample_load(logp, args.tokens, args.topk, rng)
    print(f"\ndrift: re-balance on a fresh sample of {args.tokens} tokens; moved = slots whose "
          f"expert changes, of {args.layers} x slots")
    print(f"{'ranks':>5} {'slots':>5} | {'kept':>6} {'fresh':>6} {'current':>7} | {'moved fresh':>11} "
          f"{'moved current':>13} | {'current ms':>10}")
    for ranks, slots in [(32, 288), (64, 320)]:
        before = rebalance(load, slots, ranks)
        fresh = rebalance(later, slots, ranks)
        after, after_ms = timed(partial(rebalance, later, slots, ranks, current=before), args.repeats)
        scores = [balancedness(later, p.phy2log, ranks) for p in (before, fresh, after)]
        moved = moved_slots(before, fresh), moved_slots(before, after)
        print(f"{ranks:>5} {slots:>5} | {scores[0]:>6.4f} {scores[1]:>6.4f} {scores[2]:>7.4f} | "
              f"{moved[0]:>11} {moved[1]:>13} | {after_ms:>10.1f}")
        key = f"drift_r{ranks}_s{slots}"
        summary.update({f"{key}_kept": round(scores[0], 4), f"{key}_current": round(scores[2], 4),
                        f"{key}_moved_fresh": moved[0], f"{key}_moved_current": moved[1],
                        f"{key}_current_ms": round(after_ms, 1)})
    return script.headline(summary)


if __name__ == "__main__":
    main()
