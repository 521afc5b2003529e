"""Instances of Ray actors on the session's local Ray cluster: DEP2, DEP4 and attention–FFN split
(2 attention + 2 expert ranks) give the same greedy outputs as the single-process engine for
requests arriving at different times, with EPLB re-placing skewed experts mid-generation; an idle
gang does not spin; many concurrent streams each get their tokens as they are made (with async
scheduling); a killed member
fails the requests in flight with an error naming it and the gang restarts; bad configuration fails
at creation; a gang that cannot start leaves no actors behind."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import signal
import time

import jsonschema
import pytest
import ray
from helpers import assert_same_tokens, prompt, settled_stats
from test_structured import assorted_schemas

from rackserve.cluster.faults import InstanceError
from rackserve.cluster.instance import Instance
from rackserve.config import ConfigError
from rackserve.engine import LLM, SamplingParams
from rackserve.engine.grammar import GrammarSpec
from rackserve.models.deepseek_v4.tiny import make_tiny
from rackserve.placement import InstanceGroup, PlacementSpec, plan
from rackserve.placement.ray_groups import placement_groups, remove, topology_from_ray, wait_ready

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": 64}
FIRST, LATER = [(5, 50), (33, 51), (70, 52)], [(12, 53), (41, 54), (20, 55)]  # (prompt length, seed)
RESTART_S = 25.0  # a gang restart of the tiny model: about 5 s unloaded


@pytest.fixture(scope="session")
def hot_checkpoint(tmp_path_factory):
    """The tiny model with one hot expert in every learned-routing layer (skewed expert load), as DeepSeek
    publishes V4 (FP8 linears, FP4 experts): EPLB moves the experts as stored."""
    return make_tiny(tmp_path_factory.mktemp("hot"), seed=0, hot_experts=1, fmt="published", quant="fp4")


def run_staggered(inst: Instance) -> list[list[int]]:
    """Submit three requests, wait until the first streams, submit three more; all token ids."""
    ids = [inst.submit(prompt(n, seed=s), GREEDY) for n, s in FIRST]
    first = inst.stream(ids[0])
    head = next(first)
    ids += [inst.submit(prompt(n, seed=s), GREEDY) for n, s in LATER]
    outs = [head.new_token_ids + [t for out in first for t in out.new_token_ids]]
    for request_id in ids[1:]:
        outs.append([t for out in inst.stream(request_id) for t in out.new_token_ids])
    return outs


STAGGERED = [prompt(n, seed=s) for n, s in FIRST + LATER]


@functools.cache
def single_process(checkpoint) -> list[list[int]]:
    return [c.token_ids for c in LLM(checkpoint).generate(STAGGERED, GREEDY)]


def assert_like_single_process(checkpoint, got: list[list[int]], which: slice = slice(None)) -> None:
    """`got` (the outputs of STAGGERED[which]) are the single-process engine's, up to near-ties."""
    assert_same_tokens(checkpoint, STAGGERED[which], got, single_process(checkpoint)[which], GREEDY)


def assert_eplb_rebalanced(stats: dict, min_rise: float) -> None:
    """Every member re-placed the same number of times, and the first re-placement (from the
    uniform start) made the counted load more balanced by at least `min_rise`."""
    members = stats["members"]
    assert len({m["eplb_rebalances"] for m in members}) == 1 and members[0]["eplb_rebalances"] >= 2
    before, after = members[0]["eplb_balancedness"][0]
    assert after >= before + min_rise, members[0]["eplb_balancedness"]
    assert members[0]["eplb_moved_slots"] > 0


@pytest.mark.slow
def test_dep2_instance(ray_cluster, tiny_checkpoint):
    inst = Instance(tiny_checkpoint, dep=2, redundant_slots=2, engine_kwargs=ENGINE)
    try:
        assert_like_single_process(tiny_checkpoint, run_staggered(inst))
        assert all(s["steps"] > 0 for s in inst.stats()["members"])  # both stepped (one with dummies at times)
        # ranks run at normal priority (the session's cluster is started with WORKER_ENV), not Ray's nice 15
        assert [os.getpriority(os.PRIO_PROCESS, p.pid) for p in inst.ping()] == [0, 0]

        before = [p.cpu_s for p in inst.ping()]
        steps = [s["steps"] for s in settled_stats(inst)["members"]]
        time.sleep(2.0)
        idle = [p.cpu_s - b for p, b in zip(inst.ping(), before, strict=True)]
        assert [s["steps"] for s in inst.stats()["members"]] == steps  # idle: the gang sleeps...
        assert max(idle) < 0.2, idle  # ...and does not spin (CPU seconds over 2 s idle)

        [again] = inst.generate([STAGGERED[2]], GREEDY)  # woken by new work
        assert_like_single_process(tiny_checkpoint, [again.token_ids], slice(2, 3))

        [bad] = inst.generate([prompt(9000, seed=1)], GREEDY)  # refused, the others keep going
        assert bad.finish_reason == "error" and "max_model_len" in bad.error

        for i, schema in enumerate(assorted_schemas(12)):  # structured outputs on either rank of the gang
            spec = GrammarSpec("json_schema", json.dumps(schema))
            [c] = inst.generate(["config = "], SamplingParams(structured=spec, max_tokens=160, temperature=0.8, seed=i))
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), schema)

        # n choices fork on one rank of the gang, each its seed alone in the single-process engine
        choices = SamplingParams(n=3, max_tokens=10, temperature=0.9, seed=8, ignore_eos=True, presence_penalty=0.5)
        got = inst.generate([STAGGERED[0], STAGGERED[1]], choices)
        want = LLM(tiny_checkpoint).generate([STAGGERED[0], STAGGERED[1]], choices)
        assert [(c.index, c.token_ids) for c in got] == [(c.index, c.token_ids) for c in want]
    finally:
        inst.shutdown()


@pytest.mark.slow
def test_dep4_with_eplb_on_skewed_load_equals_the_single_process_engine(ray_cluster, hot_checkpoint):
    inst = Instance(hot_checkpoint, dep=4, redundant_slots=4, engine_kwargs={**ENGINE, "eplb_interval": 4})
    try:
        assert_like_single_process(hot_checkpoint, run_staggered(inst))
        assert_eplb_rebalanced(settled_stats(inst), min_rise=0.05)
    finally:
        inst.shutdown()


@pytest.mark.slow
def test_split_instance_from_a_plan(ray_cluster, hot_checkpoint):
    """AFD2+2 placed by the planner: members land on the planned trays, outputs equal the single
    process engine's with EPLB moving experts between the expert ranks; then a killed expert rank
    fails the request in flight with an error naming it, and the restarted gang serves again."""
    p = plan(topology_from_ray(), PlacementSpec((InstanceGroup("decode", 1, 2, "afd", 2),), kv_stores="none"))
    planned = p.instances[0]
    groups = placement_groups(p, name_prefix="test-split")
    try:
        wait_ready(groups, timeout_s=60)
        # the default timeout (30 s): the killed expert rank must be seen at once, not by a timeout
        inst = Instance.from_plan(planned, groups[planned.name], hot_checkpoint,
                                  engine_kwargs={**ENGINE, "eplb_interval": 4})
        try:
            where = [(m.labels["rackserve.io/rack"], m.labels["rackserve.io/tray"]) for m in inst.ping()]
            assert where == [(g.rack, g.tray) for g in planned.all_gpus]
            assert [m.role for m in inst.ping()] == ["DP rank"] * 2 + ["expert rank"] * 2
            assert_like_single_process(hot_checkpoint, run_staggered(inst))
            # lockstep: the members' step counts settle to one (a gang out of step never would)
            assert_eplb_rebalanced(settled_stats(inst), min_rise=0.0)
            assert_member_death_is_survived(inst, member=3, name="expert rank 3", checkpoint=hot_checkpoint)
        finally:
            inst.shutdown()
    finally:
        remove(groups)


@pytest.mark.slow
def test_many_concurrent_streams_each_arrive_token_by_token(ray_cluster, tiny_checkpoint):
    """48 streams from one DP rank with async scheduling, more than its actor has threads, 16 of them
    running at a time (the others wait, as P/D requests wait for their state): every request's tokens
    reach its reader in several deliveries as they are made, not in one burst at the end, and are the
    single-process engine's."""
    inst = Instance(tiny_checkpoint, dep=1, engine_kwargs={"max_num_seqs": 16, "max_num_batched_tokens": 256,
                                                           "async_scheduling": True})
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [prompt(10, seed=300 + i) for i in range(48)]
    try:
        ids = [inst.submit(p, params) for p in prompts]

        async def arrivals(request_id: str) -> list[tuple[float, int]]:
            """When each token reached this reader (s), and the token."""
            return [(time.perf_counter(), t) async for out in inst.astream(request_id) for t in out.new_token_ids]

        async def read_all() -> list[list[tuple[float, int]]]:
            return await asyncio.gather(*map(arrivals, ids))

        got = asyncio.run(read_all())
        times = [[at for at, _ in row] for row in got]
        assert [len(t) for t in times] == [12] * len(ids)
        # tokens handed over together arrive microseconds apart; separate steps are milliseconds apart
        deliveries = [1 + sum(b - a > 1e-3 for a, b in zip(t, t[1:])) for t in times]
        assert min(deliveries) >= 3, deliveries
        want = [c.token_ids for c in LLM(tiny_checkpoint).generate(prompts, params)]
        assert_same_tokens(tiny_checkpoint, prompts, [[t for _, t in row] for row in got], want, params)
    finally:
        inst.shutdown()


@pytest.mark.slow
def test_a_dead_or_frozen_dp_rank_fails_in_flight_requests_and_the_gang_restarts(ray_cluster, tiny_checkpoint):
    # the frozen member is found by the timeout (the kill at once): long beside a tiny model's
    # steps of tens of ms even on a loaded machine, short enough for the test
    inst = Instance(tiny_checkpoint, dep=2, timeout=10.0)
    try:
        assert_member_death_is_survived(inst, member=1, name="DP rank 1", checkpoint=tiny_checkpoint)
        # a member that stops answering (its process frozen) is found by the gang's timeouts
        assert_member_death_is_survived(inst, member=1, name="DP rank 1", checkpoint=tiny_checkpoint,
                                        fault="freeze")
        assert_a_death_while_the_gang_meets_is_survived(inst, checkpoint=tiny_checkpoint)
    finally:
        inst.shutdown()


def assert_a_death_while_the_gang_meets_is_survived(inst: Instance, checkpoint) -> None:
    """A member that dies after the restart created the members and before they met (the rendezvous, the
    process group) fails that start with a clear error and leaves the instance down; the next request
    starts the gang again."""
    gang = inst._gang
    spec = gang._spec

    def meeting(*args):  # called once the restart's members run, right before they meet
        gang._spec = spec
        ray.kill(gang.members[1])
        return spec(*args)

    gang._spec = meeting
    ray.kill(inst.members[0])
    # the request ends with the failure its client saw first: the gang's (its stream) or the restart's (its
    # submit); or, when a pump's restart came first and failed, its submit's retry found that gang down and
    # started the gang again (the instance then serves at once)
    with pytest.raises(InstanceError, match=r"failed: DP rank 0 died|its gang did not start again \(.*\); the next"
                       r"|its gang did not start \(.*\); a fresh gang failed too") as caught:
        inst.generate([STAGGERED[2]], GREEDY)
    if "a fresh gang failed too" not in str(caught.value):
        deadline = time.monotonic() + RESTART_S
        while not inst.down and time.monotonic() < deadline:  # the restart that found a member dead
            time.sleep(0.1)
        assert inst.down and "did not start" in inst.down
    [again] = inst.generate([STAGGERED[2]], GREEDY)
    assert inst.down is None
    assert_like_single_process(checkpoint, [again.token_ids], slice(2, 3))


def assert_member_death_is_survived(inst: Instance, member: int, name: str, checkpoint, fault: str = "kill") -> None:
    restarts = inst.stats()["restarts"]
    long = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
    stream = inst.stream(inst.submit(prompt(20, seed=3), long))  # lands on DP rank 0
    next(stream)
    if fault == "kill":
        ray.kill(inst.members[member])
    else:
        os.kill(inst.ping()[member].pid, signal.SIGSTOP)  # the restart's kill ends it
    start = time.monotonic()
    # the survivors notice at their next exchange (host sync or expert all-to-all), within the timeout
    what = "died" if fault == "kill" else "stopped answering"
    with pytest.raises(InstanceError, match=rf"was lost: .* instance .* failed: {name} {what}.*resubmit"):
        for _ in stream:
            pass
    # the stream ends once the gang has restarted: a death is seen at once, a freeze after the
    # timeout, and a restart takes seconds (RESTART_S allows for a loaded machine)
    assert time.monotonic() - start < (0 if fault == "kill" else inst.timeout) + RESTART_S
    assert inst.stats()["restarts"] == restarts + 1
    [again] = inst.generate([STAGGERED[2]], GREEDY)  # the restarted gang serves
    assert_like_single_process(checkpoint, [again.token_ids], slice(2, 3))


@pytest.mark.parametrize("kwargs,match", [
    ({"dep": 0}, "dep=0 must be an integer ≥ 1"),
    ({"expert_ranks": -1}, "expert_ranks=-1"),
    ({"redundant_slots": -2}, "redundant_slots=-2"),
    ({"engine_kwargs": {"max_num_seqs": 0}}, "max_num_seqs=0"),
    ({"engine_kwargs": {"max_num_seq": 4}}, "engine_kwargs: .*max_num_seq.*EngineConfig's fields"),
    ({"model": "/nonexistent/ckpt"}, "no config.json in /nonexistent/ckpt; pass a checkpoint directory"),
], ids=["dep", "expert_ranks", "redundant", "engine_value", "engine_field", "model_path"])
def test_bad_configuration_fails_at_creation_naming_the_fix(tiny_checkpoint, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Instance(**{"model": tiny_checkpoint, **kwargs})  # fails before any actor exists: no Ray needed


def _alive_ranks(cluster) -> int:
    """Rank actors alive on the session's cluster (named by address: another cluster may run on this host)."""
    from ray.util.state import list_actors

    return len(list_actors(address=cluster.address, filters=[("class_name", "=", "DPRank"), ("state", "=", "ALIVE")],
                           limit=10_000))


def test_a_gang_that_cannot_start_names_the_cause_and_leaves_no_actors(ray_cluster, tiny_checkpoint, tmp_path):
    """Members that fail to load (a truncated weights file) fail the start with the loader's message, and
    every member is killed: a failed start must not hold its ranks (their GPUs, their placement group),
    even while the error is kept (its traceback holds the half-built instance, as a test report does)."""
    broken = shutil.copytree(tiny_checkpoint, tmp_path / "broken")
    [weights] = broken.glob("*.safetensors")
    os.truncate(weights, weights.stat().st_size // 2)
    before = _alive_ranks(ray_cluster)
    with pytest.raises(Exception, match="file is truncated or not safetensors") as kept:
        Instance(broken, dep=2)
    deadline = time.monotonic() + 30
    while _alive_ranks(ray_cluster) > before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _alive_ranks(ray_cluster) == before, kept.traceback
