"""The fault matrix over HTTP (`rackserve.bench.faults`): each fault under streams in flight, on the
session's cluster, through Serve's proxy with an HTTP client.

One app serves every row of the DEP decode instance (faults one after another: each must leave the
service as it found it, or the next row shows it); the split instance's expert rank has its own app.
Each row: no stream hangs, every stream (half greedy, half seeded samples under penalties) completes
with its undisturbed text (replayed where its decode gang failed: the replay resumes its draws and
token counts) or, for none here but the data plane's death (which takes the engines), ends with an error;
new requests succeed again; TTFT p50 after
recovery within 1.5x before (with 50 ms of slack: probes of tens of ms on a shared machine); after
recovery no push fails and no decode rank recomputes a prefill; the decode state memory in use returns
to its idle level. An ingress replica's death is `test_serve_scale_out.py`'s, a node's `test_node_loss.py`'s.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import ray
from helpers import RECOVERY_S, assert_recovered, metric

from rackserve.bench import faults
from rackserve.serve.app import delete
from rackserve.timeouts import TIMEOUTS

STREAMS, OSL, PROBES = 6, 32, 8


@pytest.fixture(scope="module")
def dep_app(serve_port, tiny_checkpoint):
    app = faults.start_app("faults-dep", {**faults.APPS["dep"], "model": str(tiny_checkpoint)}, serve_port)
    yield app
    delete(app.name)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["SIGKILL decode DP rank (EPLB moving)", "SIGSTOP decode DP rank"])
def test_a_failed_decode_gang_replays_every_stream_to_its_undisturbed_text(dep_app, fault):
    row = faults.run_fault(dep_app, fault, STREAMS, OSL, PROBES)
    assert_recovered(row, replayed=True)
    health = httpx.get(f"{dep_app.url}/health", timeout=30).json()
    assert health["status"] in ("healthy", "degraded") and all(s == "ok" for s in health["instances"].values())


@pytest.mark.slow
def test_a_second_fault_while_the_gang_restarts_is_recovered_from_too(dep_app):
    """The decode rank's replacement is killed as soon as its process runs: that start fails, the gang is
    started once more (by the owner's watcher or a replay's next try), and every stream still ends with its
    undisturbed text."""
    restarts = ray.get(dep_app.plane.stats.remote())["decode"][0]["restarts"]
    row = faults.run_fault(dep_app, "SIGKILL decode DP rank, again as it restarts", STREAMS, OSL, PROBES)
    assert_recovered(row, replayed=True)
    # the start the second kill struck, then the one that runs
    assert ray.get(dep_app.plane.stats.remote())["decode"][0]["restarts"] >= restarts + 2


@pytest.mark.slow
def test_a_dead_prefill_rank_costs_recomputation_not_streams(dep_app):
    fault = "SIGKILL prefill DP rank (prefilling)"
    row = faults.run_fault(dep_app, fault, STREAMS, OSL, PROBES)
    # struck while it prefilled them: their decode ranks prefill the lost ones themselves, and every stream
    # ends with its undisturbed text (no decode rank failed: nothing to replay)
    assert row.redone >= 1, row
    assert_recovered(row, replayed=False)


@pytest.mark.slow
def test_a_dead_kv_store_is_replaced_and_caches_again(dep_app):
    fault = "SIGKILL KV store"
    row = faults.run_fault(dep_app, fault, STREAMS, OSL, PROBES)
    assert_recovered(row, replayed=False)
    # the replacement is registered with the ranks: a finished request's prefix is written to it and
    # found there by the next turn (the prefill rank's own cache would serve that turn as well: what the
    # replacement holds and hits is counted on its own)
    health = httpx.get(f"{dep_app.url}/health", timeout=30).json()
    assert health["kv_stores"] == "1/1" and health["kv_stores_replaced"] >= 1, health
    stored, hits = (f'rackserve_kv_store{{kind="{k}",tier="host"}}' for k in ("bytes_in_use", "hit_tokens"))
    before = metric(dep_app.url, stored)
    turn = [11 + i % 400 for i in range(80)]
    first = faults.stream(dep_app.url, turn, 4)
    assert first.error is None
    deadline = time.monotonic() + 60
    while metric(dep_app.url, stored) <= before:  # the decode rank writes the finished turn
        assert time.monotonic() < deadline, "the replacement KV store took nothing in 60 s"
        time.sleep(0.1)
    hit_before = metric(dep_app.url, hits)
    second = faults.stream(dep_app.url, turn + [5, 6, 7], 4)
    assert second.error is None
    usage = httpx.post(f"{dep_app.url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": turn + [5, 6, 7, 8], "max_tokens": 1, "temperature": 0}).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 64, usage
    assert metric(dep_app.url, hits) - hit_before >= 64  # found in the replacement store too


@pytest.mark.slow
def test_a_stopped_kv_store_is_given_up_then_replaced(dep_app):
    """A KV store whose process is stopped (SIGSTOP: a stalled host) answers nothing: a lookup of it is given
    up after `TIMEOUTS.store_call_s` and requests go on without it, so no stream and no new request waits on
    it; once it has answered no ping for `TIMEOUTS.store_stall_s` it is replaced, the stopped process killed."""
    [pid] = ray.get(dep_app.plane.store_pids.remote())
    replaced = httpx.get(f"{dep_app.url}/health", timeout=30).json()["kv_stores_replaced"]
    row = faults.run_fault(dep_app, "SIGSTOP KV store", STREAMS, OSL, PROBES)
    assert_recovered(row, replayed=False)
    assert row.recovery_s < TIMEOUTS.store_stall_s, row  # a lookup given up, not a replacement waited for
    deadline = time.monotonic() + 60
    while (health := httpx.get(f"{dep_app.url}/health", timeout=30).json())["kv_stores_replaced"] == replaced:
        assert time.monotonic() < deadline, f"the stopped store was not replaced in 60 s: {health}"
        time.sleep(0.5)
    assert health["kv_stores"] == "1/1", health
    while Path(f"/proc/{pid}").exists():  # (a zombie until its parent reaps it)
        assert time.monotonic() < deadline, f"the stopped store's process {pid} outlived its replacement"
        time.sleep(0.5)


@pytest.mark.slow
def test_a_dead_serve_controller_costs_no_stream(dep_app):
    row = faults.run_fault(dep_app, "SIGKILL Serve controller", STREAMS, OSL, PROBES)
    assert_recovered(row, replayed=False)  # Ray restarts it; the proxy and the replicas never needed it


@pytest.mark.slow
def test_a_dead_data_plane_ends_its_streams_with_errors_and_is_built_again(dep_app):
    """The engines die with the data plane that owns them: their streams end with an error (none hangs,
    none parts from its text), Serve replaces the replicas its health check finds without one, and the new
    replica builds the data plane again, which then serves as before. Last of the app's rows."""
    row = faults.run_fault(dep_app, "SIGKILL data plane actor", STREAMS, OSL, PROBES)
    assert row.hung == 0 and row.differed == 0 and row.completed + row.errored == row.streams, row
    assert row.errored >= 1, row  # those in flight had no engine left
    assert row.recovery_s < 2 * RECOVERY_S, row  # a health check period, then a whole data plane's start
    assert row.push_failures_after == 0 and row.recomputed_after == 0 and row.memory_back, row
    health = httpx.get(f"{dep_app.url}/health", timeout=30).json()
    assert health["status"] == "healthy" and all(s == "ok" for s in health["instances"].values()), health


@pytest.mark.slow
def test_a_dead_expert_rank_replays_its_instances_streams(serve_port, tiny_checkpoint):
    app = faults.start_app("faults-afd", {**faults.APPS["afd"], "model": str(tiny_checkpoint)}, serve_port)
    try:
        fault = "SIGKILL expert rank (AFD)"
        row = faults.run_fault(app, fault, STREAMS, OSL, PROBES)
        assert_recovered(row, replayed=True)
    finally:
        delete(app.name)
