"""A DEP2 instance of Ray actors on a local Ray cluster: same greedy outputs as the single-process
engine, no stepping while idle, waking up for new work, bad input answered with an error."""

from __future__ import annotations

import time

import pytest
import ray

from conftest import prompt
from rackserve.engine import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def local_ray():
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, object_store_memory=100 << 20)
    yield
    ray.shutdown()


@pytest.mark.slow
def test_dep2_instance(local_ray, tiny_checkpoint):
    from rackserve.actors.instance import Instance

    inst = Instance(tiny_checkpoint, dep=2, redundant_slots=2,
                    engine_kwargs={"max_num_seqs": 4, "max_num_batched_tokens": 64})
    try:
        prompts = [prompt(n, seed=50 + n) for n in (5, 33, 70, 12, 41)]
        got = inst.generate(prompts, GREEDY)
        want = LLM(tiny_checkpoint).generate(prompts, GREEDY)
        assert [g["token_ids"] for g in got] == [w.token_ids for w in want]
        assert all(g["finish_reason"] == "length" for g in got)
        assert all(s["steps"] > 0 for s in inst.stats())  # both ranks stepped (one with dummies at times)

        before = [s["steps"] for s in inst.stats()]
        time.sleep(0.5)
        assert [s["steps"] for s in inst.stats()] == before  # idle: the gang sleeps instead of spinning

        [again] = inst.generate([prompts[2]], GREEDY)  # woken by new work
        assert again["token_ids"] == got[2]["token_ids"]

        [bad] = inst.generate([prompt(9000, seed=1)], GREEDY)
        assert "max_model_len" in bad["finish_reason"]
    finally:
        inst.shutdown()


@pytest.mark.slow
def test_a_dead_rank_fails_in_flight_requests_with_a_clear_error(local_ray, tiny_checkpoint):
    from rackserve.actors.instance import Instance

    inst = Instance(tiny_checkpoint, dep=2, timeout=3.0)
    try:
        long = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
        request = inst.submit(prompt(20, seed=3), long)  # lands on rank 0
        stream = inst.stream(request)
        next(stream)
        ray.kill(inst.ranks[1])
        start = time.monotonic()
        # the survivor notices at its next exchange (host sync or expert all-to-all) within the timeout
        with pytest.raises(ray.exceptions.RayTaskError, match="DP rank 0 of 2 stopped: the DEP gang failed"):
            for _ in stream:
                pass
        assert time.monotonic() - start < 15
    finally:
        inst.shutdown()
