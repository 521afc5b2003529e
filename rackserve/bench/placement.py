"""Benchmark: the rack planner vs a naive first-fit, on 1, 10 and 100 NVL72 racks.

    python -m rackserve.bench.placement [--racks 1,10,100] [--repeats 5]

The workload is N rack-equivalents of one mix (72 GPUs each, so N racks is the optimum):
decode 1 x DEP32 + 1 x DEP16, prefill 8 x DEP2 + 2 x DEP4. Both planners get 2N racks, so
neither runs out and "racks used" compares them.

The naive first-fit is what one writes without a planner: instances in the order given (prefill
groups, then decode, as on the command line), each onto the lowest-numbered free GPUs of the first
rack with enough of them. It keeps instances inside a rack, like ours, but does not sort or look
at trays. Reported: plan time (median of --repeats), racks used, idle GPUs in the racks used,
stranded GPUs (Plan.stranded_gpus) and small instances (<= 4 GPUs) split across trays.
The last line is one JSON object with the headline figures.
"""

from __future__ import annotations

import statistics
import time

from rackserve.bench import script
from rackserve.placement import GpuId, InstanceGroup, PlacementSpec, Plan, PlannedInstance, Topology, plan

# (role, instances per rack-equivalent, DEP size), in the order a user lists them.
MIX = (("prefill", 8, 2), ("prefill", 2, 4), ("decode", 1, 32), ("decode", 1, 16))


def mix_spec(rack_equivalents: int) -> PlacementSpec:
    return PlacementSpec(tuple(InstanceGroup(role, n * rack_equivalents, size) for role, n, size in MIX))


def naive_first_fit(topology: Topology, spec: PlacementSpec) -> Plan:
    """Spec order; each instance on the lowest free GPUs (tray by tray) of the first rack with room."""
    free = [[GpuId(r.name, t.name, g) for t in r.trays for g in range(t.num_gpus)] for r in topology.racks]
    instances = []
    for group in spec.groups:
        for i in range(group.count):
            r = next((r for r, gpus in enumerate(free) if len(gpus) >= group.gpus), None)
            if r is None:
                raise RuntimeError(f"naive first-fit: {group.role} instance {i} ({group.shape}) does not fit")
            gpus, free[r] = tuple(free[r][:group.gpus]), free[r][group.gpus:]
            instances.append(PlannedInstance(group.role, i, group.mode, group.shape, gpus[:group.size],
                                             gpus[group.size:]))
    return Plan(topology, spec, tuple(instances), ())


def measure(planner, topology: Topology, spec: PlacementSpec, repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = planner(topology, spec)
        times.append(time.perf_counter() - start)
    racks = {i.rack for i in result.instances}
    rack_gpus = sum(r.num_gpus for r in topology.racks if r.name in racks)
    split = sum(len(i.all_gpus) <= 4 and len({g.tray for g in i.all_gpus}) > 1 for i in result.instances)
    return {"plan_ms": 1e3 * statistics.median(times), "racks_used": result.racks_used,
            "idle_gpus": rack_gpus - result.gpus_used, "stranded_gpus": result.stranded_gpus,
            "split_small": split, "instances": len(result.instances)}


def main(argv: list[str] | None = None) -> dict:
    parser = script.parser(__doc__)
    parser.add_argument("--racks", type=script.int_list, default="1,10,100",
                        help="rack-equivalents of the mix (comma list)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    mix = ", ".join(f"{n} x {role} DEP{size}" for role, n, size in MIX)
    print(f"mix per rack-equivalent (72 GPUs): {mix}; topology: 2N NVL72 racks (18 trays x 4 GPUs)")
    print("idle = free GPUs in the racks used; stranded = free GPUs in partly used trays too few for the "
          "smallest instance; split = instances of <= 4 GPUs spread over trays")
    print()
    header = (f"{'N':>4} {'instances':>9}  {'planner':<16} {'plan ms':>8} {'racks used':>10} {'idle':>5} "
              f"{'stranded':>8} {'split':>5}")
    print(header)
    print("-" * len(header))
    headline = {"mix": mix}
    for n in args.racks:
        topology, spec = Topology.nvl72(2 * n), mix_spec(n)
        rows = {"rackserve": measure(plan, topology, spec, args.repeats),
                "naive first-fit": measure(naive_first_fit, topology, spec, args.repeats)}
        for name, row in rows.items():
            print(f"{n:>4} {row['instances']:>9}  {name:<16} {row['plan_ms']:>8.2f} {row['racks_used']:>10} "
                  f"{row['idle_gpus']:>5} {row['stranded_gpus']:>8} {row['split_small']:>5}")
        ours, naive = rows["rackserve"], rows["naive first-fit"]
        headline[f"n{n}"] = {"plan_ms": round(ours["plan_ms"], 2), "racks_used": ours["racks_used"],
                             "naive_racks_used": naive["racks_used"], "stranded_gpus": ours["stranded_gpus"],
                             "naive_stranded_gpus": naive["stranded_gpus"], "idle_gpus": ours["idle_gpus"],
                             "naive_idle_gpus": naive["idle_gpus"]}
    return script.headline(headline)


if __name__ == "__main__":
    main()
