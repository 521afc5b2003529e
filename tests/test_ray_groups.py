"""A plan on a real (local) Ray cluster: every rank's actor and every KV store lands on the rack and
tray the plan chose. The cluster: 2 racks x 2 trays, each tray a node with 2 logical GPUs (Ray
accepts GPUs without devices) and its rack/tray labels; the head node is rack0/tray0."""

from __future__ import annotations

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rackserve.placement import InstanceGroup, PlacementSpec, Rack, Topology, Tray, plan
from rackserve.placement.ray_groups import (
    bundles,
    kv_store_options,
    placement_groups,
    remove,
    topology_from_ray,
    wait_ready,
)

RACKS, TRAYS, GPUS = 2, 2, 2


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():  # another module's cluster: this one needs its own labelled nodes
        ray.shutdown()
    node = {"num_cpus": 1, "num_gpus": GPUS, "object_store_memory": 80 << 20}
    trays = [(f"rack{r}", f"tray{t}") for r in range(RACKS) for t in range(TRAYS)]
    labels = [{"rackserve.io/rack": r, "rackserve.io/tray": t} for r, t in trays]
    c = Cluster(initialize_head=True, head_node_args={**node, "labels": labels[0]})
    for lab in labels[1:]:
        c.add_node(**node, labels=lab)
    c.wait_for_nodes()
    ray.init(address=c.address)
    yield c
    ray.shutdown()
    c.shutdown()


@ray.remote
class Where:
    def labels(self) -> tuple[str, str]:
        labels = ray.get_runtime_context().get_node_labels()
        return labels["rackserve.io/rack"], labels["rackserve.io/tray"]


def test_topology_from_ray_reads_the_labels(cluster):
    assert topology_from_ray().racks == Topology.uniform(RACKS, TRAYS, GPUS).racks


def test_every_rank_and_kv_store_lands_where_planned(cluster):
    spec = PlacementSpec((InstanceGroup("decode", 1, 4),  # spans both trays of one rack
                          InstanceGroup("prefill", 1, 2),
                          InstanceGroup("decode", 1, 1, "afd", 1)))
    p = plan(topology_from_ray(), spec)
    assert p.gpus_used == RACKS * TRAYS * GPUS  # every tray of the cluster is used
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


def test_wait_ready_names_the_groups_that_cannot_be_placed(cluster):
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
