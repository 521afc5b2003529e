"""Losing a whole Ray node under streams, over HTTP (`rackserve.bench.faults`' node row), on the
session's cluster (`RackCluster`: 2 racks x 2 trays, a node each).

The app is placed by the rack planner: decode instance 0 on the head's tray, decode instance 1 on
the next, the prefill instance in the other rack, a KV store per tray, the ingress replica on the head
node. The node of decode instance 1 is killed at once (its ranks and KV store with it) while streams
run: its streams are replayed on decode instance 0, the instance is re-planned onto the free tray,
its store replaced in the same rack, and the prefill instance, whose pushes to the lost ranks fail
(NIXL: remote disconnect), goes on. Then the prefill instance's node is lost, on the same app (each row
must leave the service as it found it, or the next shows it). Each lost node joins again afterwards,
for the tests that follow.
"""

from __future__ import annotations

import httpx
import pytest
import ray
from helpers import assert_recovered, free_port
from ray import serve

from rackserve.bench import faults
from rackserve.serve.app import delete

STREAMS, OSL, PROBES = 6, 32, 8
FAULT = "node loss (a decode tray)"


@pytest.fixture(scope="module")
def node_app(ray_cluster, tiny_checkpoint):
    """The planned app of both rows, on a Serve instance of its own (its proxy on the head node)."""
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    app = faults.start_app("faults-node", {**faults.APPS["node"], "model": str(tiny_checkpoint)}, port, ray_cluster)
    try:
        yield app
    finally:
        delete(app.name)
        serve.shutdown()
        ray_cluster.restore()


@pytest.mark.slow
def test_losing_a_tray_replays_its_streams_elsewhere_and_replans_its_instance(ray_cluster, node_app):
    app = node_app
    try:
        before = ray.get(app.plane.trays.remote())
        lost = before["decode-DEP2-1"][0]
        assert lost != "rack0/tray0" and before["decode-DEP2-0"][0] == "rack0/tray0", before
        row = faults.run_fault(app, FAULT, STREAMS, OSL, PROBES)
        assert_recovered(row, replayed=None)
        assert 0 < row.replayed < row.streams, row  # the lost instance's streams, on the other one

        after = ray.get(app.plane.trays.remote())
        assert lost not in after["decode-DEP2-1"] and len(set(after["decode-DEP2-1"])) == 1, after
        assert after["decode-DEP2-0"] == before["decode-DEP2-0"] and after["prefill-DEP1-0"] == before["prefill-DEP1-0"]
        stats = ray.get(app.plane.stats.remote())
        assert [i["restarts"] for i in stats["prefill"]] == [0], stats["prefill"]  # failed pushes are not its end
        health = httpx.get(f"{app.url}/health", timeout=30).json()
        assert all(s == "ok" for s in health["instances"].values()), health
        assert health["kv_stores"] == "3/3" and health["kv_stores_replaced"] >= 1, health
    finally:
        ray_cluster.restore()


@pytest.mark.slow
def test_losing_the_prefill_tray_while_it_prefills_costs_only_recomputation(ray_cluster, node_app):
    """The prefill instance's node is killed while its rank holds the streams' prompts (and its tray's KV
    store with it): the decode ranks' reservations expire and they prefill the prompts themselves, every
    stream completes with its undisturbed text, and the instance is re-planned onto a tray that lives."""
    app = node_app
    try:
        before = ray.get(app.plane.trays.remote())
        replaced = httpx.get(f"{app.url}/health", timeout=30).json()["kv_stores_replaced"]
        lost = before["prefill-DEP1-0"][0]
        assert lost != "rack0/tray0", before
        row = faults.run_fault(app, "node loss (prefill tray, prefilling)", STREAMS, OSL, PROBES)
        assert_recovered(row, replayed=False)  # nothing to replay: the decode ranks held their streams
        assert row.redone >= 1, row  # reservations given up with the prompts the lost rank held

        after = ray.get(app.plane.trays.remote())
        assert lost not in after["prefill-DEP1-0"], after
        assert after["decode-DEP2-0"] == before["decode-DEP2-0"] and after["decode-DEP2-1"] == before["decode-DEP2-1"]
        health = httpx.get(f"{app.url}/health", timeout=30).json()
        assert all(s == "ok" for s in health["instances"].values()), health
        assert health["kv_stores_replaced"] > replaced, health  # the lost tray's store
    finally:
        ray_cluster.restore()
