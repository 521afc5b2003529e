"""A `Plan` on a Ray cluster: one placement group per instance, bundles pinned by node labels.

    pgs = placement_groups(plan)                  # {instance name: PlacementGroup}
    wait_ready(pgs, timeout_s=120)
    strategy = PlacementGroupSchedulingStrategy(pgs[inst.name], placement_group_bundle_index=rank)
    KVStore.options(**kv_store_options(plan.kv_stores[0])).remote(...)

Each instance gets one bundle per GPU (DP ranks, then expert ranks in afd mode, as
`PlannedInstance.all_gpus`), each with a bundle label selector `rackserve.io/rack=R, rackserve.io/tray=T`
naming the tray the plan chose. The selectors do the placing, so the group's strategy is PACK:
STRICT_PACK would demand one node, and an instance of more than one tray spans several nodes
(NVL72: a tray is a node of 4 GPUs). Ray then picks the GPU inside the node.

This is the only module of rackserve.placement that imports Ray.
"""

from __future__ import annotations

from collections.abc import Mapping

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from rackserve.placement.planner import Plan, PlannedInstance, PlannedStore
from rackserve.placement.topology import RACK_LABEL, TRAY_LABEL, Rack, Topology, TopologyError


def label_selector(rack: str, tray: str) -> dict[str, str]:
    """The node labels of one tray, as a Ray label selector."""
    return {RACK_LABEL: rack, TRAY_LABEL: tray}


def bundles(inst: PlannedInstance, resources: Mapping[str, float] | None = None) -> tuple[list[dict], list[dict]]:
    """(bundles, bundle label selectors) of one instance, one of each per GPU in `inst.all_gpus`.

    resources: what one bundle reserves, default {"GPU": 1}; tests on machines without GPUs may
    name a custom logical resource instead, or add CPUs for the rank actors.
    """
    per_gpu = dict(resources or {"GPU": 1.0})
    return ([dict(per_gpu) for _ in inst.all_gpus],
            [label_selector(g.rack, g.tray) for g in inst.all_gpus])


def placement_groups(plan: Plan, resources: Mapping[str, float] | None = None,
                     name_prefix: str = "rackserve") -> dict[str, PlacementGroup]:
    """Create (asynchronously) one placement group per instance of `plan`, named
    `<name_prefix>-<instance name>`; returns them by instance name. Wait with `wait_ready`."""
    return {inst.name: placement_group_of(inst, resources, name_prefix) for inst in plan.instances}


def placement_group_of(inst: PlannedInstance, resources: Mapping[str, float] | None = None,
                       name_prefix: str = "rackserve") -> PlacementGroup:
    """Create (asynchronously) the placement group of one planned instance (see `placement_groups`)."""
    bs, selectors = bundles(inst, resources)
    return placement_group(bs, strategy="PACK", name=f"{name_prefix}-{inst.name}", bundle_label_selector=selectors)


def lost_node(group: PlacementGroup) -> bool:
    """Whether `group` was placed and has lost a node since: Ray re-places its bundles from that node
    only on a node that matches their label selectors, i.e. once a node of the same tray joins."""
    return ray.util.placement_group_table(group)["state"] == "RESCHEDULING"


def alive_trays() -> set[tuple[str, str]]:
    """(rack, tray) of every alive Ray node with rack/tray labels."""
    return {(n["Labels"][RACK_LABEL], n["Labels"][TRAY_LABEL]) for n in ray.nodes()
            if n.get("Alive") and RACK_LABEL in n.get("Labels", {}) and TRAY_LABEL in n.get("Labels", {})}


def live_topology(topology: Topology) -> Topology:
    """`topology` without its trays that have no alive Ray node labelled with them (racks left with no
    tray go too): where a plan can put instances now. Raises TopologyError if nothing is left."""
    alive = alive_trays()
    racks = tuple(Rack(r.name, trays) for r in topology.racks
                  if (trays := tuple(t for t in r.trays if (r.name, t.name) in alive)))
    if not racks:
        raise TopologyError(f"no alive Ray node is labelled with a tray of topology {topology.name!r}")
    return Topology(racks, topology.name)


def wait_ready(groups: Mapping[str, PlacementGroup], timeout_s: float = 120.0) -> None:
    """Block until every group is placed; raise TimeoutError naming the groups that are not."""
    refs = {pg.ready(): name for name, pg in groups.items()}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    missing = sorted(set(refs.values()) - {refs[r] for r in ready})
    if missing:
        raise TimeoutError(f"placement groups not ready after {timeout_s:.0f} s: {missing}; check that the "
                           f"cluster has alive nodes labelled {RACK_LABEL}=<rack>, {TRAY_LABEL}=<tray> for "
                           "every tray in the plan, with enough free resources (compare "
                           "`topology_from_ray()` with the plan's topology)")


def remove(groups: Mapping[str, PlacementGroup]) -> None:
    """Remove the placement groups (their actors are killed by Ray)."""
    for pg in groups.values():
        remove_placement_group(pg)


def kv_store_options(store: PlannedStore, num_cpus: float = 1.0, alive: set[tuple[str, str]] | None = None) -> dict:
    """`.options(...)` for a KV-store actor: pinned to its tray by label, using no GPU. With `alive` (the
    trays that have a node now, `alive_trays()`), a store whose tray has none is pinned to its rack
    instead, or to no node if its whole rack is gone: a store is a cache, better near than nowhere."""
    if alive is None or (store.rack, store.tray) in alive:
        selector = label_selector(store.rack, store.tray)
    else:
        selector = {RACK_LABEL: store.rack} if any(rack == store.rack for rack, _ in alive) else {}
    return {"num_cpus": num_cpus, "num_gpus": 0, **({"label_selector": selector} if selector else {})}


def topology_from_ray(resource: str = "GPU") -> Topology:
    """The connected Ray cluster's topology, from its nodes' rack/tray labels (see Topology.from_nodes)."""
    return Topology.from_nodes(ray.nodes(), resource=resource)
