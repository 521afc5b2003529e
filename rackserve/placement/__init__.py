"""Placement: topology (racks, trays, GPUs), the rack planner, expert placement (EPLB), and (in
ray_groups, the only module here that imports Ray) the mapping of a plan onto Ray placement groups.

    from rackserve.placement import InstanceGroup, PlacementSpec, Topology, plan
    spec = PlacementSpec((InstanceGroup.parse("3xDEP32", "decode"), InstanceGroup.parse("8xDEP2", "prefill")))
    print(plan(Topology.nvl72(4), spec).table())
"""

from rackserve.placement.eplb import (
    Placement,
    balancedness,
    choose_slots,
    greedy_reference,
    moved_slots,
    rebalance,
)
from rackserve.placement.planner import (
    GpuId,
    HostDemand,
    InstanceGroup,
    PlacementError,
    PlacementSpec,
    Plan,
    PlannedInstance,
    PlannedStore,
    TrayHost,
    plan,
)
from rackserve.placement.topology import RACK_LABEL, TRAY_LABEL, Rack, Topology, TopologyError, Tray

__all__ = ["RACK_LABEL", "TRAY_LABEL", "GpuId", "HostDemand", "InstanceGroup", "Placement", "PlacementError",
           "PlacementSpec", "Plan", "PlannedInstance", "PlannedStore", "Rack", "Topology", "TopologyError", "Tray",
           "TrayHost", "balancedness", "choose_slots", "greedy_reference", "moved_slots", "plan", "rebalance"]
