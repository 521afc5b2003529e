"""A P/D deployment on the session's Ray cluster (a DEP1 prefill instance, a DEP2 decode instance with
EPLB, one KV store; real NIXL between the actors; the published FP8+FP4 checkpoint): outputs equal
the single-process engine's, a session's second turn prefills only its new text, and a killed prefill rank or KV store costs recomputation,
not requests (on a deployment of its own); requests submitted at once from many threads all reach
the decode ranks within a few steps."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
from helpers import assert_same_tokens, prompt

from rackserve.cluster.deployment import Deployment
from rackserve.engine import LLM, SamplingParams

# a reservation outlives any push of a healthy run, however loaded the machine: in the shared
# deployment nothing expires unless a test makes it (the test that does has a deployment of its own)
ENGINE = {"max_num_seqs": 8, "max_num_batched_tokens": 96, "kv_timeout_s": 60.0}


@pytest.fixture(scope="module")
def deployment(ray_cluster, published_fp4):
    """Shared by the tests that leave it as they found it (no member or store killed). It serves the
    checkpoint as DeepSeek publishes it (FP8 linears, FP4 experts), and its decode instance re-places
    the quantized experts (EPLB) every 4 steps."""
    dep = Deployment(published_fp4, prefill="1xDEP1", decode="1xDEP2", kv_stores=1, engine_kwargs=ENGINE,
                     store_memory_mb=16, timeout=10.0, decode_engine_kwargs={"eplb_interval": 4})
    yield dep
    dep.shutdown()


def assert_like_single(checkpoint, prompts, got: list[list[int]], params) -> None:
    """`got` are the single-process engine's outputs of `prompts`, up to near-ties."""
    want = [c.token_ids for c in LLM(checkpoint).generate(prompts, params)]
    assert_same_tokens(checkpoint, prompts, got, want, params)


def totals(dep: Deployment, role: str) -> dict:
    """Counters summed over every DP rank of a role."""
    out = {}
    for inst in dep.stats()[role]:
        for member in inst["members"]:
            for k, v in member.items():
                if k.startswith("kv_"):
                    out[k] = out.get(k, 0) + v
    return out


@pytest.mark.slow
def test_pd_outputs_equal_the_single_process_engine(deployment, published_fp4):
    prompts = [prompt(n, seed=60 + n) for n in (7, 90, 33, 150, 12, 61)]
    params = [SamplingParams(max_tokens=m, temperature=t, seed=5 + i, ignore_eos=True)
              for i, (m, t) in enumerate([(8, 0), (5, 0), (12, 0.8), (6, 0), (1, 0), (9, 1.0)])]
    before = totals(deployment, "decode")
    got = deployment.generate(prompts, params)
    assert_like_single(published_fp4, prompts, [g.token_ids for g in got], params)
    after = totals(deployment, "decode")
    assert after["kv_loaded"] - before.get("kv_loaded", 0) == len(prompts)  # every state was pushed
    [decode] = deployment.stats()["decode"]
    assert decode["members"][0]["eplb_rebalances"] > 0  # quantized experts moved while requests ran
    assert after["kv_recomputed"] == before.get("kv_recomputed", 0)


@pytest.mark.slow
def test_a_second_turn_prefills_only_its_new_text(deployment, published_fp4):
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    turn1 = prompt(40, seed=71)
    puts = deployment.stats()["kv_stores"][0]["puts"]
    [first] = deployment.generate([turn1], greedy, sessions=["chat"])
    turn2 = turn1 + first.token_ids + prompt(13, seed=72)
    deadline = time.monotonic() + 60
    # the decode rank writes prompt + answer back as the request finishes, asynchronously: a user's
    # next turn comes seconds later, this test's at once, so it waits for the write to land
    while deployment.stats()["kv_stores"][0]["puts"] < puts + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    pulled_before = totals(deployment, "prefill").get("kv_pulled_tokens", 0)
    [second] = deployment.generate([turn2], greedy, sessions=["chat"])
    assert_like_single(published_fp4, [turn2], [second.token_ids], greedy)
    block = 16  # the tiny model's block size: history up to the answer's last full block is reused
    assert second.num_cached_tokens == (len(turn1) + len(first.token_ids) - 1) // block * block
    assert totals(deployment, "prefill")["kv_pulled_tokens"] - pulled_before == second.num_cached_tokens


@pytest.mark.slow
def test_a_dead_kv_store_and_a_dead_prefill_rank_cost_only_recomputation(ray_cluster, tiny_checkpoint):
    # a deployment of its own, as it kills parts of it; the reservation of a request whose prefill
    # rank died expires after kv_timeout_s (a wait, not a race: nothing can push it any more)
    deployment = Deployment(tiny_checkpoint, prefill="1xDEP1", decode="1xDEP1", kv_stores=1,
                            engine_kwargs={**ENGINE, "kv_timeout_s": 4.0}, store_memory_mb=16, timeout=10.0)
    try:
        kill_a_store_and_a_prefill_rank(deployment, tiny_checkpoint)
    finally:
        deployment.shutdown()


def kill_a_store_and_a_prefill_rank(deployment: Deployment, tiny_checkpoint) -> None:
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    # the store dies between a lookup (its prefix pinned for the prefill rank) and the prefill rank's READ
    # of it, and is replaced (the ranks forget its agent): the READ fails to start, and the prefix is
    # prefilled instead. (Before the ranks forget it, a READ on one host may still succeed: UCX was seen
    # reading a killed store's memory, the whole prefix intact.) Turn 1's 60-token
    # prompt leaves 48 tokens in the prefill rank's own cache; the store holds 64 of prompt + answer, so
    # turn 2 (both, and more) is read from the store, not served by the rank's cache
    first = prompt(60, seed=78)
    [answer] = deployment.generate([first], greedy)  # turn 1: its prompt + answer are written to the store
    turn2 = first + answer.token_ids + [7, 8, 9]
    deadline = time.monotonic() + 30
    while getattr(ray.get(deployment.stores[0].lookup.remote(turn2)), "num_tokens", 0) < 64:
        assert time.monotonic() < deadline, "turn 1 never reached the store"
        time.sleep(0.1)
    lookup, hits = deployment.client._lookup, []
    failures, replaced = totals(deployment, "prefill").get("kv_pull_failures", 0), deployment.stores_replaced

    def then_the_store_dies(decode_at, ids):
        hits.append(lookup(decode_at, ids))
        store = deployment.stores[0]
        ray.kill(store)
        deadline = time.monotonic() + 30
        while True:  # dead before the READ starts (a kill lands asynchronously): no race
            try:
                ray.get(store.stats.remote(), timeout=30)
            except ray.exceptions.RayActorError:
                break
            assert time.monotonic() < deadline, "the killed store still answers after 30 s"
            time.sleep(0.05)
        deployment.replace_dead_stores()  # done here or by the owner's watcher: either way, done on return
        assert deployment.stores_replaced == replaced + 1
        return hits[-1]

    deployment.client._lookup = then_the_store_dies
    try:
        [second] = deployment.generate([turn2], greedy)
    finally:
        deployment.client._lookup = lookup
    assert hits[0] is not None and hits[0].num_tokens >= 64, hits  # a pinned prefix it could not read
    pulls = {k: v for k, v in totals(deployment, "prefill").items() if "pull" in k}
    assert pulls["kv_pull_failures"] == failures + 1, pulls  # the READ was tried, and failed
    assert_like_single(tiny_checkpoint, [turn2], [second.token_ids], greedy)

    ray.kill(deployment.stores[0])
    prompts = [prompt(n, seed=80 + n) for n in (20, 45)]
    got = deployment.generate(prompts, greedy)  # lookups fail: plain prefill
    assert_like_single(tiny_checkpoint, prompts, [g.token_ids for g in got], greedy)
    assert set(deployment.client.dead_stores) == {0}  # found by the client that looked a prefix up

    before = totals(deployment, "decode").get("kv_recomputed", 0)
    # a prompt of 19 prefill steps (96-token budget), killed once the prefill rank runs it, long before
    # it could push (killed earlier, the request could still reach the restarted gang and be pushed)
    request = deployment.submit(prompt(1800, seed=90), greedy)
    deadline = time.monotonic() + 60
    while not any(m.get("running") for inst in deployment.stats()["prefill"] for m in inst["members"]):
        assert time.monotonic() < deadline, "the prefill rank never started the request"
        time.sleep(0.005)
    ray.kill(deployment.prefill[0].members[0])  # its push never comes: the reservation expires
    tokens = [t for out in deployment.stream(request) for t in out.new_token_ids]
    assert_like_single(tiny_checkpoint, [prompt(1800, seed=90)], [tokens], greedy)
    assert totals(deployment, "decode")["kv_recomputed"] == before + 1
    [again] = deployment.generate([prompt(25, seed=91)], greedy)  # the prefill instance restarts
    assert_like_single(tiny_checkpoint, [prompt(25, seed=91)], [again.token_ids], greedy)


@pytest.mark.slow
def test_a_refused_request_fails_alone(deployment, published_fp4):
    """A request the decode rank refuses (a prompt beyond max_model_len) raises the rank's reason to
    its caller; the gang is not restarted, and a request in flight goes on to its end."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    running = deployment.submit(prompt(20, seed=95), greedy)
    generation = deployment.decode[0].generation
    with pytest.raises(ValueError, match="max_model_len"):
        deployment.submit(prompt(5000, seed=96), greedy)
    assert deployment.decode[0].generation == generation
    tokens = [t for out in deployment.stream(running) for t in out.new_token_ids]
    assert_like_single(published_fp4, [prompt(20, seed=95)], [tokens], greedy)


@pytest.mark.slow
def test_concurrent_submits_reach_the_decode_ranks_within_a_few_steps(deployment, published_fp4):
    """24 requests submitted at once from threads (as the HTTP ingress submits) while both decode
    ranks decode, so that every gang step runs a forward: all 24 reservations are made within a few
    steps, not one request per step."""
    users = 24
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    busy = [deployment.stream(deployment.submit(prompt(20, seed=100 + i), long)) for i in range(2)]  # one per rank
    for stream in busy:
        next(stream)
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [prompt(12, seed=200 + i) for i in range(users)]
    start = threading.Barrier(users)

    def submit(ids: list[int]) -> str:
        start.wait()
        return deployment.submit(ids, short)

    def steps() -> int:
        return deployment.stats()["decode"][0]["members"][0]["steps"]  # the ranks step in lockstep

    before = steps()
    with ThreadPoolExecutor(users) as pool:
        ids = list(pool.map(submit, prompts))
    took = steps() - before
    for stream in busy:
        stream.close()  # aborts them
    got = [[t for out in deployment.stream(r) for t in out.new_token_ids] for r in ids]
    assert_like_single(published_fp4, prompts, got, short)
    # one request per step would take 24 steps or more; batched admissions take 1-2 unloaded, and on a
    # loaded machine the threads' calls themselves spread over several of the tiny model's short steps
    assert took <= 3 * users // 4, f"{users} concurrent submits took {took} decode steps"


@pytest.mark.slow
def test_a_decode_only_deployment_prefills_on_its_decode_ranks(ray_cluster, tiny_checkpoint):
    """prefill="none": one DEP2 instance prefills what it serves, at once (no reservation waits for a push
    that cannot come: a 60 s one would show in the time and the counters), with outputs equal to the
    single-process engine's; a conversation's next turn finds its history cached."""
    from rackserve.config import ConfigError

    with pytest.raises(ConfigError, match=r"at least one decode instance, and a prefill instance unless "
                                          r"prefill='none'"):
        Deployment(tiny_checkpoint, prefill="0xDEP1", decode="1xDEP1")
    dep = Deployment(tiny_checkpoint, prefill="none", decode="1xDEP2", kv_stores=1, engine_kwargs=ENGINE,
                     store_memory_mb=16, timeout=10.0)
    try:
        assert not dep.prefill and not dep.stats()["prefill"]
        greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        prompts = [prompt(n, seed=120 + n) for n in (9, 40, 70)]
        start = time.monotonic()
        got = [c.token_ids for c in dep.generate(prompts, greedy)]
        assert time.monotonic() - start < ENGINE["kv_timeout_s"]
        assert_like_single(tiny_checkpoint, prompts, got, greedy)
        [again] = dep.generate([prompts[2] + got[2] + [5, 6]], greedy)
        assert again.num_cached_tokens >= 64
        decode = totals(dep, "decode")
        assert decode["kv_reserved"] == decode["kv_recomputed"] == 0, decode
    finally:
        dep.shutdown()


@pytest.mark.slow
def test_a_controller_places_the_deployment_with_the_rack_planner(ray_cluster, tiny_checkpoint):
    """topology "ray": the planner places a DEP1 prefill and a DEP2 decode instance on the labelled
    cluster, with a KV store on every tray in use; every rank and store runs where planned."""
    from rackserve.serve.config import ServeConfig
    from rackserve.serve.controller import Controller

    config = ServeConfig(model=str(tiny_checkpoint), prefill="1xDEP1", decode="1xDEP2", kv_stores="per_tray",
                         topology="ray", engine=ENGINE, store_memory_mb=16)
    controller = Controller(config)
    try:
        dep = controller.deployment
        for inst in dep.prefill + dep.decode:
            planned = controller.plan.instance(inst.name)
            where = [(p.labels["rackserve.io/rack"], p.labels["rackserve.io/tray"]) for p in inst.ping()]
            assert where == [(g.rack, g.tray) for g in planned.gpus]
        assert len(dep.stores) == len(controller.plan.kv_stores) >= 1
        assert controller.health()["healthy"]
        greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        got = dep.generate([prompt(21, seed=3)], greedy)
        assert_like_single(tiny_checkpoint, [prompt(21, seed=3)], [got[0].token_ids], greedy)
    finally:
        controller.shutdown()
