"""Topology and rack planner: the planner's rules on hundreds of random specs, its errors, topology
files, the text table and `rackserve plan` (no Ray here: see test_ray_groups.py)."""

from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from rackserve.placement import (
    HostDemand,
    InstanceGroup,
    PlacementError,
    PlacementSpec,
    Plan,
    Rack,
    Topology,
    TopologyError,
    Tray,
    plan,
)
from rackserve.placement.planner import RANK_PROCESS_BYTES

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGIES = ROOT / "deploy" / "topology"


def spec(*groups: str, **kw) -> PlacementSpec:
    """spec("decode:3xDEP32", "prefill:8xDEP2")"""
    return PlacementSpec(tuple(InstanceGroup.parse(g.split(":")[1], g.split(":")[0]) for g in groups), **kw)


def random_topology(rng: random.Random) -> Topology:
    if rng.random() < 0.4:
        return Topology.nvl72(rng.randint(1, 3))
    sizes = rng.choice([[4], [8], [2, 4], [4, 8], [1, 2, 4]])
    return Topology(tuple(Rack(f"r{r}", tuple(Tray(f"t{t}", rng.choice(sizes)) for t in range(rng.randint(1, 8))))
                          for r in range(rng.randint(1, 4))), "random")


def random_spec(rng: random.Random, topo: Topology) -> PlacementSpec:
    largest = topo.largest_rack
    groups = {}
    for _ in range(rng.randint(1, 4)):
        role = rng.choice(["prefill", "decode"])
        size = rng.choice([1, 2, 2, 3, 4, 4, 6, 8, 16, 32])
        if rng.random() < 0.15:
            g = InstanceGroup(role, rng.randint(0, 3), size, "afd", rng.choice([1, 2, 4, 8]))
        else:
            g = InstanceGroup(role, rng.randint(0, 6), size)
        if g.gpus <= largest:
            groups[role, g.shape] = g
    if not any(g.count for g in groups.values()):
        groups["decode", "DEP1"] = InstanceGroup("decode", 1, 1)
    return PlacementSpec(tuple(groups.values()), kv_stores=rng.choice(["per_tray", "per_rack", "none"]),
                         spread=rng.random() < 0.3)


def check_rules(topo: Topology, sp: PlacementSpec, p: Plan) -> None:
    trays = {(r.name, t.name): t.num_gpus for r in topo.racks for t in r.trays}
    largest_tray = {r.name: max(t.num_gpus for t in r.trays) for r in topo.racks}
    all_gpus = [g for inst in p.instances for g in inst.all_gpus]
    assert len(all_gpus) == len(set(all_gpus)), "a GPU is used twice"
    assert all((g.rack, g.tray) in trays and 0 <= g.gpu < trays[g.rack, g.tray] for g in all_gpus)
    for inst in p.instances:
        assert len({g.rack for g in inst.all_gpus}) == 1, f"{inst.name} spans racks"
        if len(inst.all_gpus) <= largest_tray[inst.rack]:
            assert len({g.tray for g in inst.all_gpus}) == 1, f"{inst.name} fits in a tray but spans trays"
    wanted = Counter({(g.role, g.shape): g.count for g in sp.groups if g.count})
    assert Counter((i.role, i.shape) for i in p.instances) == wanted
    for g in sp.groups:
        insts = [i for i in p.instances if (i.role, i.shape) == (g.role, g.shape)]
        assert [i.index for i in insts] == list(range(g.count))
        assert all(len(i.gpus) == g.size and len(i.expert_gpus) == g.expert_ranks and i.mode == g.mode
                   for i in insts)
    used = {(g.rack, g.tray) for g in all_gpus}
    kv = [(k.rack, k.tray) for k in p.kv_stores]
    if sp.kv_stores == "per_tray":
        assert sorted(kv) == sorted(used)
    elif sp.kv_stores == "per_rack":
        first = {r.name: r.trays[0].name for r in topo.racks}
        assert sorted(kv) == sorted({(g.rack, first[g.rack]) for g in all_gpus})
    else:
        assert kv == []
    assert p.gpus_used == len(all_gpus) and p.racks_used == len({g.rack for g in all_gpus})


def kept(before: Plan, after: Plan, keys=None) -> bool:
    """Every instance of `before` (or those with `keys`) has the same GPUs in `after`."""
    now = {i.key: i.all_gpus for i in after.instances}
    return all(now.get(i.key) == i.all_gpus for i in before.instances if keys is None or i.key in keys)


def with_count(sp: PlacementSpec, group: InstanceGroup, delta: int) -> PlacementSpec:
    return replace(sp, groups=tuple(replace(g, count=g.count + delta) if g == group else g for g in sp.groups))


def test_rules_hold_on_random_specs():
    rng = random.Random(1234)
    feasible = infeasible = 0
    for _ in range(400):
        topo = random_topology(rng)
        sp = random_spec(rng, topo)
        try:
            p = plan(topo, sp)
        except PlacementError as e:
            assert "does not fit" in str(e) and "add racks" in str(e)
            infeasible += 1
            continue
        feasible += 1
        check_rules(topo, sp, p)
        assert plan(topo, sp) == p, "not deterministic"
        # the same spec with its groups listed in another order: the same plan
        assert plan(topo, replace(sp, groups=sp.groups[::-1])).instances == p.instances

        # Adding one instance: the ones placed before it never move; with `previous`, none moves.
        group = rng.choice(sp.groups)
        bigger = with_count(sp, group, +1)
        try:
            fresh = plan(topo, bigger)
        except PlacementError:
            continue
        order = [(g.role, g.shape, i) for g in bigger.canonical_groups for i in range(g.count)]
        before_new = set(order[:order.index((group.role, group.shape, group.count))])
        assert kept(p, fresh, before_new)
        if group == sp.canonical_groups[-1]:
            assert kept(p, fresh)
        grown = plan(topo, bigger, previous=p)
        check_rules(topo, bigger, grown)
        assert kept(p, grown)

        # Removing one: with `previous`, every other instance stays.
        group = rng.choice([g for g in sp.groups if g.count])
        if sum(g.count for g in sp.groups) > 1:
            smaller = with_count(sp, group, -1)
            shrunk = plan(topo, smaller, previous=p)
            check_rules(topo, smaller, shrunk)
            assert kept(shrunk, p) and len(shrunk.instances) == len(p.instances) - 1
    assert feasible > 200 and infeasible > 10  # both paths were exercised


def test_previous_replaces_instances_whose_rack_is_gone():
    p = plan(Topology.nvl72(3), spec("decode:4xDEP32", "prefill:4xDEP4"))
    assert {i.rack for i in p.instances} == {"rack0", "rack1"}
    without_rack0 = Topology(tuple(r for r in Topology.nvl72(3).racks if r.name != "rack0"))
    p2 = plan(without_rack0, p.spec, previous=p)
    assert kept(p2, p, {i.key for i in p.instances if i.rack == "rack1"})
    assert all(i.rack in ("rack1", "rack2") for i in p2.instances)


def test_first_fit_decreasing_fills_racks_exactly():
    # per rack: 1 x DEP32 + 1 x DEP16 + 2 x DEP4 + 8 x DEP2 = 72 GPUs; listed smallest first on purpose
    p = plan(Topology.nvl72(20), spec("prefill:80xDEP2", "prefill:20xDEP4", "decode:10xDEP32", "decode:10xDEP16"))
    assert p.racks_used == 10 and p.gpus_used == 720 and p.stranded_gpus == 0
    # DEP32 takes 8 whole trays; small instances share trays before opening new ones
    assert len({g.tray for g in p.instance("decode-DEP32-0").gpus}) == 8
    assert p.instance("prefill-DEP2-0").gpus[0].tray == p.instance("prefill-DEP2-1").gpus[0].tray


def test_spread_puts_each_role_on_different_racks():
    packed = plan(Topology.nvl72(4), spec("prefill:4xDEP2", "decode:2xDEP16"))
    spread = plan(Topology.nvl72(4), spec("prefill:4xDEP2", "decode:2xDEP16", spread=True))
    assert packed.racks_used == 1
    assert Counter(i.rack for i in spread.instances if i.role == "prefill") == Counter(
        {"rack0": 1, "rack1": 1, "rack2": 1, "rack3": 1})
    assert len({i.rack for i in spread.instances if i.role == "decode"}) == 2


def test_stranded_gpus_count_free_gpus_no_instance_can_use():
    topo = Topology.uniform(1, 2, 8)
    p = plan(topo, spec("decode:1xDEP6", "prefill:1xDEP3"))  # DEP6 in tray0 (2 left < 3), DEP3 in tray1
    assert [len({g.tray for g in i.gpus}) for i in p.instances] == [1, 1]
    assert p.stranded_gpus == 2
    assert p.stranded_per_rack() == Counter({"rack0": 2})  # tray1 has 5 free: room for another DEP3
    assert plan(topo, spec("decode:1xDEP6", "prefill:1xDEP2")).stranded_gpus == 0


def test_afd_instances_keep_attention_and_experts_in_one_rack():
    p = plan(Topology.nvl72(2), spec("decode:2xAFD32+24", "prefill:2xDEP2"))
    for inst in p.instances[:2]:
        assert inst.mode == "afd" and len(inst.gpus) == 32 and len(inst.expert_gpus) == 24
        assert len({g.rack for g in inst.all_gpus}) == 1
    assert p.racks_used == 2


@pytest.mark.parametrize("topo, sp, message", [
    (Topology.nvl72(4), spec("decode:1xDEP96"),
     "decode DEP96 needs 96 GPUs in one NVLink domain; the largest has 72"),
    (Topology.nvl72(4), spec("prefill:145xDEP2"),
     "prefill instance 144 (DEP2) does not fit: all 4 racks are full (288 GPUs used of 288)"),
    (Topology.nvl72(1), spec("decode:1xAFD64+16"),
     "decode AFD64+16 needs 80 GPUs in one NVLink domain; the largest has 72"),
    (Topology.nvl72(2), spec("decode:3xDEP48"),
     ("decode instance 2 (DEP48) does not fit: no rack has 48 free GPUs (the most is 24, in rack0; "
      "48 GPUs free of 144)")),
    (Topology.uniform(1, 2, 4), spec("prefill:3xDEP3"),
     ("prefill instance 2 (DEP3) does not fit: it must stay in one tray and no tray has 3 free GPUs "
      "(the most is 1, in rack0/tray0; 2 GPUs free of 8)")),
])
def test_infeasible_specs_say_which_instance_and_why(topo, sp, message):
    with pytest.raises(PlacementError) as e:
        plan(topo, sp)
    assert message in str(e.value)


@pytest.mark.parametrize("make, words", [
    (lambda: InstanceGroup.parse("8xEP2", "prefill"), ["8xEP2", "8xDEP2"]),
    (lambda: InstanceGroup.parse("2xDEP8+4", "decode"), ["+4", "AFD8+4"]),
    (lambda: InstanceGroup("encode", 1, 2), ["role='encode'", "prefill"]),
    (lambda: InstanceGroup("decode", 1, 8, "afd"), ["expert_ranks >= 1"]),
    (lambda: spec("prefill:2xDEP2", "prefill:3xDEP2"), ["prefill DEP2 is given 2 times", "merge"]),
    (lambda: spec("prefill:0xDEP2"), ["no instances"]),
    (lambda: spec("prefill:DEP2", kv_stores="per_gpu"), ["kv_stores='per_gpu'", "per_tray"]),
])
def test_spec_errors_name_the_input_and_the_fix(make, words):
    with pytest.raises(PlacementError) as e:
        make()
    assert all(w in str(e.value) for w in words), str(e.value)


def test_parse_shapes():
    assert InstanceGroup.parse("8xDEP2", "prefill") == InstanceGroup("prefill", 8, 2)
    assert InstanceGroup.parse("dep32", "decode") == InstanceGroup("decode", 1, 32)
    g = InstanceGroup.parse("2xAFD8+16", "decode")
    assert (g.count, g.size, g.mode, g.expert_ranks, g.gpus, g.shape) == (2, 8, "afd", 16, 24, "AFD8+16")


def test_nvl72_preset_shape():
    topo = Topology.nvl72(2)
    assert [r.name for r in topo.racks] == ["rack0", "rack1"]
    assert all(len(r.trays) == 18 and all(t.num_gpus == 4 for t in r.trays) for r in topo.racks)
    assert topo.num_gpus == 144 and topo.largest_rack == 72
    assert topo.racks[0].trays[17].name == "tray17"


def test_topology_files():
    gb300 = Topology.from_yaml(TOPOLOGIES / "gb300-nvl72x4.yaml")
    assert [[(t.name, t.num_gpus) for t in r.trays] for r in gb300.racks] == \
        [[(t.name, t.num_gpus) for t in r.trays] for r in Topology.nvl72(4).racks] and gb300.name == "gb300-nvl72x4"
    assert {t.host_memory_gib for r in gb300.racks for t in r.trays} == {894}
    h200 = Topology.from_yaml(TOPOLOGIES / "h200-8gpu.yaml")
    assert [(r.name, [(t.name, t.num_gpus) for t in r.trays]) for r in h200.racks] == [("h200-0", [("node0", 8)])]
    dev = Topology.from_yaml(TOPOLOGIES / "cpu-dev.yaml")
    assert dev.num_gpus == 4 and len(dev.racks) == 1 and len(dev.racks[0].trays) == 1


@pytest.mark.parametrize("text, words", [
    ("name: x\n", ["'racks' must be a non-empty list"]),
    ("racks: []\n", ["'racks' must be a non-empty list"]),
    ("rack: []\n", ["unknown field(s) ['rack']", "allowed: name, racks"]),
    ("racks:\n  - {trays: 2, gpus_per_tray: 4}\n", ["racks[0]", "missing field 'name'"]),
    ("racks:\n  - {name: a, trays: 2}\n", ["racks[0] (a)", "gpus_per_tray"]),
    ("racks:\n  - {name: a, trays: 2, gpus_per_tray: 4, gpu: 1}\n", ["racks[0]", "unknown field(s) ['gpu']"]),
    ("racks:\n  - {name: a, trays: [{name: t, gpus: 0}]}\n", ["racks[0].trays[0].gpus", "0 must be an integer >= 1"]),
    ("racks:\n  - {name: a, trays: [{name: t}]}\n", ["racks[0].trays[0]", "{name: <label>, gpus: <int>"]),
    ("racks:\n  - {name: a, trays: 2, gpus_per_tray: 4, host_memory_gib: 0}\n",
     ["racks[0] (a)", "host_memory_gib=0 must be a number of GiB > 0"]),
    ("racks:\n  - {name: a, trays: [{name: t, gpus: 4}], host_memory_gib: 8}\n",
     ["'host_memory_gib' only goes with 'trays: <count>'"]),
    ("racks:\n  - {name: a, trays: [{name: t, gpus: 4}, {name: t, gpus: 4}]}\n", ["rack a", "tray name 't'"]),
    ("racks:\n  - {name: 'rack 0', trays: 1, gpus_per_tray: 4}\n", ["racks[0].name", "'rack 0'", "label value"]),
    ("racks:\n  - {name: a, trays: 1, gpus_per_tray: 4}\n  - {name: a, trays: 1, gpus_per_tray: 4}\n",
     ["rack name 'a' appears twice"]),
    ("racks: [\n", ["not valid YAML"]),
])
def test_topology_file_errors_name_the_field(tmp_path, text, words):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(TopologyError) as e:
        Topology.from_yaml(path)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_missing_topology_file(tmp_path):
    with pytest.raises(TopologyError, match="cannot read topology file"):
        Topology.from_yaml(tmp_path / "nope.yaml")


def node(node_id, gpus, rack=None, tray=None, alive=True):
    labels = {"ray.io/node-id": node_id}
    if rack is not None:
        labels |= {"rackserve.io/rack": rack, "rackserve.io/tray": tray}
    return {"NodeID": node_id, "Alive": alive, "Labels": labels, "Resources": {"CPU": 8.0, "GPU": float(gpus)}}


def test_topology_from_node_labels():
    nodes = [node("head", 0), node("n3", 4, "rb", "t1"), node("n1", 4, "ra", "t1"), node("n2", 4, "ra", "t0"),
             node("dead", 4, "ra", "t2", alive=False)]
    topo = Topology.from_nodes(nodes)
    assert [(r.name, [(t.name, t.num_gpus) for t in r.trays]) for r in topo.racks] == [
        ("ra", [("t0", 4), ("t1", 4)]), ("rb", [("t1", 4)])]
    numbered = Topology.from_nodes([node(f"n{t}", 4, "r", f"tray{t}") for t in (10, 2, 1)])
    assert [t.name for t in numbered.racks[0].trays] == ["tray1", "tray2", "tray10"]
    with pytest.raises(TopologyError, match="node n9 has 4 GPU but no rackserve.io/rack"):
        Topology.from_nodes(nodes + [node("n9", 4)])
    with pytest.raises(TopologyError, match="two nodes are labelled rackserve.io/rack=ra, rackserve.io/tray=t0"):
        Topology.from_nodes(nodes + [node("n9", 4, "ra", "t0")])
    with pytest.raises(TopologyError, match="no alive Ray node has the resource 'TPU'"):
        Topology.from_nodes(nodes, resource="TPU")


def test_table_lists_instances_racks_and_summary():
    p = plan(Topology.nvl72(4), spec("prefill:8xDEP2", "decode:3xDEP32", "decode:1xAFD8+6"))
    text = p.table()
    lines = text.splitlines()
    assert lines[0].startswith("nvl72x4: 4 racks, 288 GPUs. Plan: 2 racks used, 126 GPUs used, 0 stranded")
    assert any(line.split()[:5] == ["decode-DEP32-0", "dep", "32", "rack0", "tray0..tray7"] for line in lines)
    assert any(line.startswith("prefill-DEP2-7") for line in lines)
    assert any("attention tray" in line and "| experts" in line for line in lines if "AFD8+6" in line)
    assert any(line.split()[:3] == ["rack0", "72/72", "0"] for line in lines)
    assert len([line for line in lines if line.startswith(("prefill-", "decode-"))]) == 12


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rackserve.cli", "plan", *args], check=False,
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_cli_prints_the_plan_and_writes_a_png(tmp_path):
    png = tmp_path / "plan.png"
    topology = str(TOPOLOGIES / "gb300-nvl72x4.yaml")
    out = run_cli("--topology", topology, "--prefill", "8xDEP2", "--decode", "3xDEP32", "--spread", "--png", str(png))
    assert out.returncode == 0, out.stderr
    assert "decode-DEP32-2" in out.stdout and "spread" in out.stdout.splitlines()[0]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    bad = run_cli("--topology", topology, "--decode", "DEP96")
    assert bad.returncode == 2 and "the largest has 72" in bad.stderr


# ---- host memory per tray ------------------------------------------------------------------------------

GIB = 2**30


def tray_topology(gib: float) -> Topology:
    """One rack of four 4-GPU trays with `gib` GiB of host memory each."""
    return Topology((Rack("r", tuple(Tray(f"t{t}", 4, gib) for t in range(4))),))


def test_a_tray_holds_the_tables_once_a_store_and_its_ranks():
    demand = HostDemand(tables=100 * GIB, store=50 * GIB, prefill_rank=2 * GIB, decode_rank=3 * GIB)
    p = plan(tray_topology(1000), spec("decode:1xDEP4", "prefill:2xDEP2", host=demand))
    trays = {t.tray: t for t in p.host_memory()}
    # decode DEP4 fills t0; the two prefill DEP2 share t1
    assert (trays["t0"].tables, trays["t0"].stores, trays["t0"].ranks) == (100 * GIB, 50 * GIB, 4 * 3 * GIB)
    assert (trays["t1"].tables, trays["t1"].ranks, trays["t1"].capacity) == (100 * GIB, 4 * 2 * GIB, 1000 * GIB)
    assert set(trays) == {"t0", "t1"}
    assert "host memory, the fullest tray: r/t0: tables 100.0 + KV store 50.0 + ranks 12.0 = 162.0 of 1000.0 GiB" \
        in p.table()


def test_expert_ranks_read_no_tables():
    demand = HostDemand(tables=100 * GIB, decode_rank=GIB)
    p = plan(tray_topology(1000), spec("decode:1xAFD4+4", kv_stores="none", host=demand))
    trays = {t.tray: t for t in p.host_memory()}
    assert (trays["t0"].tables, trays["t0"].ranks) == (100 * GIB, 4 * GIB)
    assert (trays["t1"].tables, trays["t1"].ranks) == (0, 0)


def test_a_plan_a_tray_cannot_hold_is_refused_with_the_numbers():
    demand = HostDemand(tables=189 * GIB, store=256 * GIB, decode_rank=4 * GIB)
    with pytest.raises(PlacementError) as e:
        plan(tray_topology(400), spec("decode:1xDEP4", host=demand))
    assert ("1 tray(s) lack the host memory this plan needs, e.g. r/t0: tables 189.0 + KV store 256.0 + ranks 16.0 "
            "= 461.0 of 400.0 GiB") in str(e.value) and "store_memory_mb" in str(e.value)
    # a topology that does not give the trays' memory is not checked
    assert plan(Topology.uniform(1, 4, 4), spec("decode:1xDEP4", host=demand)).host_overflow() == []


def test_the_serve_config_says_what_its_ranks_keep_in_host_memory():
    from rackserve.models import read_config
    from rackserve.models.deepseek_v41 import FLASH_CONFIG
    from rackserve.serve.config import ServeConfig

    flash = read_config(FLASH_CONFIG)
    config = ServeConfig(store_memory_mb=1024, engine={"kv_pool_mb": 512, "device": "cuda"},
                         prefill_engine={"device": "cpu", "state_memory_mb": 2048})
    demand = config.host_demand(flash)
    assert demand.tables == flash.host_table_bytes and demand.store == GIB
    assert demand.decode_rank == RANK_PROCESS_BYTES  # a GPU rank keeps its pool and state on the GPU
    assert demand.prefill_rank == RANK_PROCESS_BYTES + (512 + 2048) * 2**20


def test_rackserve_plan_and_memory_account_the_published_config_per_tray(tmp_path):
    gb300 = ROOT / "deploy" / "gb300-nvl72.yaml"
    out = subprocess.run([sys.executable, "-m", "rackserve.cli", "plan", "--config", str(gb300)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert "fullest tray: rack0/tray0: tables 188.8 + KV store 256.0 + ranks 16.0 = 460.8 of 894.0 GiB" in out.stdout
    text = gb300.read_text().replace("store_memory_mb: 262144", "store_memory_mb: 786432")
    (tmp_path / "big-store.yaml").write_text(text.replace("deploy/topology/", f"{TOPOLOGIES}/"))
    out = subprocess.run([sys.executable, "-m", "rackserve.cli", "plan", "--config", str(tmp_path / "big-store.yaml")],
                         capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert out.returncode == 2 and "KV store 768.0" in out.stderr and "of 894.0 GiB" in out.stderr
    big = str(tmp_path / "big-store.yaml")
    out = subprocess.run([sys.executable, "-m", "rackserve.cli", "memory", "--config", big],
                         capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert out.returncode == 0 and "tray(s) lack it, e.g. rack0/tray0" in out.stdout
