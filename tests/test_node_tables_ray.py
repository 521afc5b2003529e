"""The tiny V4.1's Engram tables as a node resource on the session's Ray cluster
(`rackserve.actors.table_host`): a DEP4 instance over two trays maps one copy per node (counted in the
ranks' memory maps), shared by the node's two ranks, and answers as the single-process engine; a killed
rank comes back onto the same pages without the tables being read again; a killed table host is
restarted by Ray and adopts its predecessor's copy; a host nobody uses removes its copy and ends."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from helpers import assert_same_tokens, mapped_sets, node_sets, prompt

from rackserve.actors.table_host import NAMESPACE, TableHost
from rackserve.cluster.faults import InstanceError
from rackserve.cluster.instance import Instance
from rackserve.engine import LLM, SamplingParams
from rackserve.models import host_tables
from rackserve.models.node_tables import NodeTables
from rackserve.placement import InstanceGroup, PlacementSpec, plan
from rackserve.placement.ray_groups import placement_groups, remove, topology_from_ray, wait_ready

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [prompt(n, seed=80 + n) for n in (9, 40, 23, 64)]
RESTART_S = 90.0  # a gang restart of the tiny model: seconds unloaded


def table_inodes(sets: list[Path]) -> dict[Path, int]:
    """The inode of every table file of `sets` (not the owner's pid, which an adopting host rewrites)."""
    return {f: f.stat().st_ino for s in sets for f in s.iterdir() if f.name != "owner"}


def host_of(directory: Path):
    return ray.get_actor(directory.name, namespace=NAMESPACE)


def serve_again(inst: Instance) -> list[list[int]]:
    """The outputs of PROMPTS once the gang has restarted (a request on the dead gang fails first)."""
    deadline = time.monotonic() + RESTART_S
    while True:
        try:
            return [c.token_ids for c in inst.generate(PROMPTS, GREEDY)]
        except InstanceError:
            assert time.monotonic() < deadline, "the gang did not restart"
            time.sleep(0.5)


@pytest.mark.slow
def test_a_dep4_instance_over_two_trays_maps_one_copy_per_node_and_restarts_onto_it(ray_cluster, v41_checkpoint,
                                                                                     tmp_path):
    want = [c.token_ids for c in LLM(v41_checkpoint).generate(PROMPTS, GREEDY)]
    p = plan(topology_from_ray(), PlacementSpec((InstanceGroup("decode", 1, 4, "dep"),), kv_stores="none"))
    planned = p.instances[0]
    groups = placement_groups(p, name_prefix="test-tables")
    engine = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "table_dir": str(tmp_path)}
    try:
        wait_ready(groups, timeout_s=60)
        inst = Instance.from_plan(planned, groups[planned.name], v41_checkpoint, engine_kwargs=engine, timeout=10.0)
        try:
            assert_same_tokens(v41_checkpoint, PROMPTS, [c.token_ids for c in inst.generate(PROMPTS, GREEDY)],
                               want, GREEDY)
            # two trays, two ranks each: one set per tray, both ranks of a tray on it, every table in it
            per_tray = node_sets(inst.ping())
            assert len(per_tray) == 2 and all(len(sets) == 1 for sets in per_tray.values()), per_tray
            sets = sorted(s for found in per_tray.values() for s in found)
            assert len(set(sets)) == 2 and sorted(tmp_path.iterdir()) == sets  # nothing else was published
            tensors = len(host_tables(v41_checkpoint))
            for m in inst.ping():
                [(_directory, mappings)] = mapped_sets(m.pid).items()
                assert mappings >= tensors
            hosts = {s: ray.get(host_of(s).stats.remote()) for s in sets}
            assert all(h["published"] == 1 and not h["adopted"] for h in hosts.values()), hosts
            assert sorted(pid for h in hosts.values() for pid in h["users"]) == sorted(m.pid for m in inst.ping())
            inodes = table_inodes(sets)

            # a killed rank comes back onto the same pages: its host published nothing again
            before = inst.ping()[1].pid
            ray.kill(inst.members[1])
            assert_same_tokens(v41_checkpoint, PROMPTS, serve_again(inst), want, GREEDY)
            assert inst.ping()[1].pid != before and node_sets(inst.ping()) == per_tray
            assert [ray.get(host_of(s).stats.remote())["published"] for s in sets] == [1, 1]

            # a killed host is restarted by Ray and adopts the copy; a rank restarted after it maps it again
            first = sets[0]
            ray.kill(host_of(first), no_restart=False)
            deadline = time.monotonic() + RESTART_S
            after = hosts[first]
            # the kill is asynchronous: a call made just after it may still be answered by the old process
            while after["pid"] == hosts[first]["pid"]:
                assert time.monotonic() < deadline, "the table host was not restarted"
                try:
                    after = ray.get(host_of(first).stats.remote(), timeout=5)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    time.sleep(0.5)
            assert after["adopted"] and after["published"] == 0
            ray.kill(inst.members[0])
            assert_same_tokens(v41_checkpoint, PROMPTS, serve_again(inst), want, GREEDY)
            assert node_sets(inst.ping()) == per_tray
            assert ray.get(host_of(first).stats.remote())["published"] == 0
            assert table_inodes(sets) == inodes  # the same table files throughout
        finally:
            inst.shutdown()
    finally:
        remove(groups)


@pytest.mark.slow
def test_a_host_nobody_uses_removes_its_copy_and_ends(ray_cluster, v41_checkpoint, tmp_path):
    node = ray.get_runtime_context().get_node_id()
    tables = NodeTables(str(tmp_path), node, tuple(host_tables(v41_checkpoint)))
    host = ray.remote(TableHost).options(num_cpus=0).remote(tables, False, 1.0)
    user = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(6)"])
    try:
        assert ray.get(host.open.remote(user.pid)) == str(tables.directory) and tables.exists()
        time.sleep(3.0)  # idle_s passed, but its user still runs: the copy stays
        assert tables.exists() and ray.get(host.stats.remote())["users"] == [user.pid]
        user.wait(timeout=30)
        deadline = time.monotonic() + 30
        while tables.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not tables.exists()
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(host.stats.remote(), timeout=30)
    finally:
        user.kill()
