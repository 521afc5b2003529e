"""A plan on a real (local) Ray cluster: every rank's actor and every KV store lands on the rack and
tray the plan chose. The cluster is the session's (conftest `ray_cluster`): 2 racks x 2 trays of 2
logical GPUs, each tray a node with its rack/tray labels."""

from __future__ import annotations

from dataclasses import replace

import pytest
import ray
from helpers import GPUS_PER_TRAY, RACKS, TRAYS
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rackserve.placement import (
    RACK_LABEL,
    TRAY_LABEL,
    InstanceGroup,
    PlacementSpec,
    PlannedStore,
    Rack,
    Topology,
    Tray,
    plan,
)
from rackserve.placement.ray_groups import (
    alive_trays,
    bundles,
    kv_store_options,
    live_topology,
    placement_groups,
    remove,
    topology_from_ray,
    wait_ready,
)
from rackserve.timeouts import TIMEOUTS


@ray.remote
class Where:
    def labels(self) -> tuple[str, str]:
        labels = ray.get_runtime_context().get_node_labels()
        return labels["rackserve.io/rack"], labels["rackserve.io/tray"]


def test_topology_from_ray_reads_the_labels(ray_cluster):
    assert topology_from_ray().racks == Topology.uniform(RACKS, TRAYS, GPUS_PER_TRAY).racks


def test_every_rank_and_kv_store_lands_where_planned(ray_cluster):
    spec = PlacementSpec((InstanceGroup("decode", 1, 4),  # spans both trays of one rack
                          InstanceGroup("prefill", 1, 2),
                          InstanceGroup("decode", 1, 1, "afd", 1)))
    p = plan(topology_from_ray(), spec)
    assert p.gpus_used == RACKS * TRAYS * GPUS_PER_TRAY  # every tray of the cluster is used
    groups = placement_groups(p, name_prefix="test")
    try:
        wait_ready(groups, timeout_s=60)
        actors, planned = [], []
        for inst in p.instances:
            for i, gpu in enumerate(inst.all_gpus):
                strategy = PlacementGroupSchedulingStrategy(groups[inst.name], placement_group_bundle_index=i)
                actors.append(Where.options(num_cpus=0, num_gpus=1, scheduling_strategy=strategy).remote())
                planned.append((gpu.rack, gpu.tray))
        for store in p.kv_stores:
            actors.append(Where.options(**kv_store_options(store, num_cpus=0.5)).remote())
            planned.append((store.rack, store.tray))
        assert len(p.kv_stores) == RACKS * TRAYS
        assert ray.get([a.labels.remote() for a in actors], timeout=120) == planned
        for a in actors:
            ray.kill(a)
    finally:
        remove(groups)


def test_wait_ready_names_the_groups_that_cannot_be_placed(ray_cluster):
    elsewhere = Topology((Rack("rack9", (Tray("tray0", 2),)),))  # no node has these labels
    groups = placement_groups(plan(elsewhere, PlacementSpec((InstanceGroup("prefill", 1, 2),))))
    try:
        with pytest.raises(TimeoutError, match=r"not ready after 2 s: \['prefill-DEP2-0'\]"):
            wait_ready(groups, timeout_s=2)
    finally:
        remove(groups)


def test_bundles_pin_each_gpu_by_label():
    p = plan(Topology.uniform(1, 2, 2), PlacementSpec((InstanceGroup("decode", 1, 3),)))
    bs, selectors = bundles(p.instances[0], {"GPU": 1, "CPU": 2})
    assert bs == [{"GPU": 1, "CPU": 2}] * 3
    assert selectors == [{"rackserve.io/rack": "rack0", "rackserve.io/tray": t} for t in ("tray0", "tray0", "tray1")]


def test_an_unplaceable_gang_gives_up_within_its_bound_saying_what_it_waits_for(ray_cluster, monkeypatch):
    from rackserve.cluster import gang_supervisor
    from rackserve.cluster.faults import UnplacedError
    from rackserve.cluster.instance import Instance

    # the first start's bound on placement
    monkeypatch.setattr(gang_supervisor, "TIMEOUTS", replace(TIMEOUTS, gang_start_s=2.0))
    elsewhere = Topology((Rack("rack9", (Tray("tray0", 2),)),))  # no node has these labels
    p = plan(elsewhere, PlacementSpec((InstanceGroup("prefill", 1, 1),)))
    groups = placement_groups(p, name_prefix="test")
    try:
        with pytest.raises(UnplacedError, match=r"its placement group is not placed after 2 s .*a node with those"):
            Instance.from_plan(p.instances[0], groups[p.instances[0].name], timeout=10)
    finally:
        remove(groups)


def test_a_lost_tray_leaves_the_live_topology_and_its_kv_store_moves_to_its_rack(ray_cluster):
    alive = alive_trays()
    assert alive == {(f"rack{r}", f"tray{t}") for r in range(RACKS) for t in range(TRAYS)}
    assert live_topology(Topology.uniform(3, 2, 2)).racks == Topology.uniform(RACKS, TRAYS, 2).racks  # rack2 has none
    store = PlannedStore("rack0", "tray1")
    assert kv_store_options(store, alive=alive)["label_selector"] == {RACK_LABEL: "rack0", TRAY_LABEL: "tray1"}
    without = alive - {("rack0", "tray1")}
    assert kv_store_options(store, alive=without)["label_selector"] == {RACK_LABEL: "rack0"}
    assert "label_selector" not in kv_store_options(store, alive={("rack1", "tray0")})  # its rack is gone
