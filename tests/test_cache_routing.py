"""Cache-aware routing on a P/D deployment without session ids: two decode and two prefill ranks, a
workload of conversations that share a 20-block tool prefix, routed by what the ranks' caches hold
prefills at least 1.3x fewer tokens than least-loaded routing; and a second router following the
same block journal makes the same choices. Over 7 runs here cache-aware prefilled 3.5K-4.3K of the
28.4K prompt tokens (within 7 % of the fewest possible from fresh caches), least-loaded 6.3K-8.8K:
1.47x-2.18x, median 1.90x. The spread is least-loaded's: it depends on which rank chance gives each
turn, so the bound sits below the lowest ratio seen.

Least-loaded breaks ties between idle ranks by chance, so a conversation's next turn meets the rank
holding its last turn half the time; elsewhere it recomputes what was said since its last visit
there: on two ranks, twice a turn's new tokens on average even when nothing is evicted. Memory
pressure takes it beyond that. Each prefill rank's cache holds `PREFILL_PAGES` blocks; the working
set at the end is 6 conversations x 32 blocks of their own + the 20 tool blocks, ~212 blocks: split
between the ranks (cache-aware: each conversation stays on one rank) it fits, held twice
(least-loaded: every conversation everywhere) it does not, over the last turns. (With 120 pages:
1.92-2.01x.)

The deployment has no KV store, so that what the prefill ranks' own caches hold decides (a store
holding the whole working set would give both policies the same hits).
"""

from __future__ import annotations

import random
import threading
import time

import pytest
from helpers import prompt

from rackserve.cluster.deployment import Deployment
from rackserve.cluster.deployment_client import DeploymentClient
from rackserve.cluster.request_router import RoutingConfig
from rackserve.engine import SamplingParams
from rackserve.engine.block_events import prefix_keys

BLOCK = 16
ENGINE = {"max_num_seqs": 8, "max_num_batched_tokens": 256, "kv_timeout_s": 60.0, "max_model_len": 1024}
# 8 request slots + 16 snapshots, the rest 130 pages (blocks of 16 tokens)
PREFILL_ENGINE = {"state_memory_mb": 0.975, "prefix_snapshots": 16}
PREFILL_PAGES = 130
CONVERSATIONS, TURNS, TASK, NEW = 6, 8, 48, 16
THINK_S = 0.5  # the most a conversation waits between turns: they do not move in step
TOOLS = prompt(20 * BLOCK, seed=900)


def conversations(dep: Deployment, seed: int) -> int:
    """Run CONVERSATIONS conversations of TURNS turns side by side (each turn: after up to THINK_S,
    the history, TASK new tokens, NEW tokens answered greedily); the prompt tokens every rank
    prefilled meanwhile."""
    before = prefilled(dep)
    greedy = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    errors: list[BaseException] = []

    def talk(c: int) -> None:
        think = random.Random(seed * 1000 + c)
        try:
            history = list(TOOLS)
            for turn in range(TURNS):
                time.sleep(think.uniform(0, THINK_S))  # the user (or tool) before the next turn
                history += prompt(TASK, seed=seed * 1000 + c * 50 + turn)
                [reply] = dep.generate([history], greedy)
                assert reply.error is None, reply.error
                history += reply.token_ids
        except BaseException as e:  # noqa: BLE001 - raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=talk, args=(c,)) for c in range(CONVERSATIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return prefilled(dep) - before


def prefilled(dep: Deployment) -> int:
    """Prompt tokens computed by every DP rank so far (a decode rank's recomputations included)."""
    return sum(member["prefill_tokens"] for role in ("prefill", "decode") for inst in dep.stats()[role]
               for member in inst["members"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cache_aware_routing_prefills_far_fewer_tokens_than_least_loaded(ray_cluster, tiny_checkpoint):
    dep = Deployment(tiny_checkpoint, prefill="2xDEP1", decode="2xDEP1", kv_stores=0, engine_kwargs=ENGINE,
                     prefill_engine_kwargs=PREFILL_ENGINE, decode_engine_kwargs={"state_memory_mb": 32})
    try:
        deadline = time.monotonic() + 60
        while len(dep.loads()) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert {dep.loads()[(i.name, 0)].cache_blocks for i in dep.prefill} == {PREFILL_PAGES}
        total = CONVERSATIONS * sum(len(TOOLS) + (t + 1) * TASK + t * NEW for t in range(TURNS))
        aware = conversations(dep, seed=2)  # fresh caches
        # least-loaded next: the first run's blocks, evictable, cost it nothing, and it hits none of them
        dep.client.router.config = RoutingConfig(policy="least_loaded")
        least = conversations(dep, seed=1)
        print(f"prompt tokens {total}: prefilled cache-aware {aware}, least-loaded {least} ({least / aware:.2f}x)")
        assert 1.3 * aware <= least, (aware, least, total)

        # a second router, built from the owner as an ingress replica's is, holds the same index and,
        # with the same loads, makes the same choices
        dep.client.router.config = RoutingConfig()
        other = DeploymentClient(dep, name="other")
        try:
            a, b = dep.client.router, other.router
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not (a.index.seq == b.index.seq == dep.blocks.seq):
                time.sleep(0.1)
            assert a.index.index.dump() == b.index.index.dump() == dep.blocks.index.dump()
            assert a.index.index.size > 0
            loads = dep.loads()
            for c in range(CONVERSATIONS):
                history = TOOLS + prompt(TASK, seed=2000 + c * 50)
                keys = prefix_keys(history, BLOCK)
                picks = []
                for router in (a, b):
                    router.update(loads)
                    picks.append((router.decode_rank(None, 100, keys=keys, prompt_tokens=len(history)),
                                  router.prefill_rank(None, len(history), keys)))
                assert picks[0] == picks[1]
        finally:
            other.close()
    finally:
        dep.shutdown()
