"""Expert routing of the trained `tiny-code` on held-out code: how skewed, and what live EPLB makes of it.

    python -m rackserve.bench.routing [--prompts 64] [--osl 32] [--eplb-interval 8] [--no-instance]

Part 1 (one process): `--prompts` prompts from held-out standard-library files
(`rackserve.models.code_corpus`) generate `--osl` greedy tokens; every MoE layer's routing choices
are counted (prefill and decode). Per layer: the balancedness (mean / max rank load) of DEP2 with
the experts in order (slot e = expert e, no redundancy), the hottest expert's share of the mean,
and the Zipf exponent fitted to the sorted expert loads (least squares of log load on log rank),
which `rackserve sim` assumes to be 1.0 (`rackserve.sim.scenario.ZIPF`).

Part 2 (Ray, local): the same workload through a DEP2 instance with 2 redundant slots and EPLB every
`--eplb-interval` steps; the balancedness of the load the ranks counted between re-placements,
under the layout it ran on and under the one that replaced it (averaged over the MoE layers).
"""

from __future__ import annotations

import numpy as np
import torch

from rackserve.bench import script
from rackserve.engine import LLM, SamplingParams
from rackserve.models.code_corpus import held_out_prompts
from rackserve.placement.eplb import balancedness
from rackserve.sim.scenario import ZIPF


def zipf_exponent(load: np.ndarray) -> float:
    """The exponent s of load ∝ rank^-s fitted to `load` `[E]` sorted descending (experts with no load left out)."""
    sorted_load = np.sort(load)[::-1]
    sorted_load = sorted_load[sorted_load > 0]
    ranks = np.arange(1, len(sorted_load) + 1)
    slope = np.polyfit(np.log(ranks), np.log(sorted_load), 1)[0]
    return float(-slope)


def routed_load(prompts: list[str], params: SamplingParams) -> tuple[np.ndarray, list[str]]:
    """Tokens routed to each expert of each MoE layer `[L, E]` while serving `prompts` in one process,
    and each layer's routing ("hash" or "learned")."""
    llm = LLM("tiny-code", max_num_seqs=16)
    layers = llm.engine.model.moe_layers
    counts = [torch.zeros(layer.num_experts, dtype=torch.float64) for layer in layers]

    def count(into: torch.Tensor):
        def hook(module, args, output):
            into.add_(torch.bincount(output[0].flatten(), minlength=len(into)).double())
        return hook

    hooks = [layer.gate.register_forward_hook(count(c)) for layer, c in zip(layers, counts)]
    try:
        llm.generate(prompts, params)
    finally:
        for h in hooks:
            h.remove()
    kinds = ["hash" if layer.gate.hashed else "learned" for layer in layers]
    return torch.stack(counts).numpy(), kinds


def live_eplb(prompts: list[str], params: SamplingParams, interval: int) -> list[list[float]]:
    """(before, after) balancedness of each EPLB re-placement of a DEP2 instance with 2 redundant slots."""
    from rackserve.cluster.instance import Instance

    with script.ray_cluster():
        inst = Instance("tiny-code", dep=2, redundant_slots=2,
                        engine_kwargs={"eplb_interval": interval, "max_num_seqs": 16, "max_num_batched_tokens": 512})
        try:
            inst.generate(prompts, params)
            return inst.stats()["members"][0]["eplb_balancedness"]
        finally:
            inst.shutdown()


def main(argv: list[str] | None = None) -> dict:
    parser = script.parser(__doc__)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--osl", type=int, default=32)
    parser.add_argument("--eplb-interval", type=int, default=8)
    parser.add_argument("--no-instance", action="store_true", help="skip part 2 (no Ray)")
    args = parser.parse_args(argv)
    prompts = held_out_prompts(args.prompts, chars=600)
    params = SamplingParams(max_tokens=args.osl, temperature=0.0, ignore_eos=True)
    load, kinds = routed_load(prompts, params)
    identity = np.arange(load.shape[1])[None, :]
    print(f"tiny-code, {args.prompts} held-out prompts of ≤ 600 characters, {args.osl} greedy tokens each; "
          f"{int(load[0].sum()):,} expert choices per layer (prefill and decode)")
    print(f"{'layer':>5} {'routing':>8} {'DEP2 balancedness':>18} {'hottest / mean':>15} {'Zipf s':>7}")
    layers = []
    for i, (row, kind) in enumerate(zip(load, kinds)):
        entry = {"layer": i, "routing": kind, "dep2_balancedness": round(balancedness(row[None], identity, 2), 3),
                 "hottest_over_mean": round(float(row.max() / row.mean()), 2), "zipf": round(zipf_exponent(row), 2)}
        layers.append(entry)
        print(f"{i:>5} {kind:>8} {entry['dep2_balancedness']:>18.3f} {entry['hottest_over_mean']:>15.2f} "
              f"{entry['zipf']:>7.2f}")
    learned = [e["zipf"] for e in layers if e["routing"] == "learned"]
    print(f"learned layers' Zipf exponent: mean {np.mean(learned):.2f} (rackserve sim assumes {ZIPF})")
    result = {"bench": "routing", "prompts": args.prompts, "osl": args.osl, "layers": layers,
              "learned_zipf_mean": round(float(np.mean(learned)), 2), "sim_assumed_zipf": ZIPF}
    if not args.no_instance:
        history = live_eplb(prompts, params, args.eplb_interval)
        print(f"\nDEP2 + 2 redundant slots, EPLB every {args.eplb_interval} steps: balancedness of the "
              "counted load (mean over MoE layers), before -> after each re-placement")
        for n, (before, after) in enumerate(history):
            print(f"  re-placement {n + 1}: {before:.3f} -> {after:.3f}")
        result["eplb"] = [[round(b, 3), round(a, 3)] for b, a in history]
    return script.headline(result)


if __name__ == "__main__":
    main()
