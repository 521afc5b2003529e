"""Async scheduling (`EngineConfig.async_scheduling`): step N+1 is scheduled and built while step N's
forward runs on the forward thread, its decode tokens taken from N's output on the device. Outputs
equal the synchronous engine's for ragged greedy and seeded workloads, with prefix-cache hits and
block boundaries crossed while decoding, stop tokens, preemption under a small state budget,
aborts mid-stream, fixed-shape decode, and disaggregated prefill/decode over NIXL."""

from __future__ import annotations

import pytest

from helpers import assert_same_tokens, prompt
from rackserve.config import ConfigError, EngineConfig
from rackserve.engine import LLM, SamplingParams
from test_graphs import assert_same_outputs, decode_tight_with_an_abort

# ragged: prompts across window, compression and block (16-token) boundaries, outputs of 1…40 tokens
PROMPTS = [prompt(n, seed=500 + n) for n in (3, 17, 40, 64, 129, 200, 31)]
PARAMS = [SamplingParams(max_tokens=m, temperature=t, seed=11, ignore_eos=True, logprobs=2)
          for m, t in [(24, 0.0), (9, 0.0), (40, 0.0), (16, 0.8), (21, 0.0), (12, 0.0), (1, 0.0)]]
KWARGS = dict(max_num_seqs=8, block_size=16)


def generate(checkpoint, prompts=PROMPTS, params=PARAMS, **kwargs):
    llm = LLM(checkpoint, **{**KWARGS, **kwargs})
    return llm, llm.generate(prompts, params)


def assert_nothing_held(engine) -> None:
    """No request holds state: what is in use is the prefix cache's, and the scratch request's."""
    stats, state, scratch = engine.stats(), engine.cache.state, engine.runner.dummy
    held = stats["state_bytes_in_use"] - stats["state_bytes_cached"]
    assert held == (0 if scratch is None else state.slot_bytes + len(scratch.pages) * state.page_bytes)


def test_async_equals_sync_on_a_ragged_workload(tiny_checkpoint):
    want = generate(tiny_checkpoint)[1]
    llm, got = generate(tiny_checkpoint, async_scheduling=True)
    assert_same_outputs(tiny_checkpoint, got, want, prompts=PROMPTS, params=PARAMS)
    engine = llm.engine
    assert engine.forward_thread.busy_s > 0 and engine._in_flight is None
    assert_nothing_held(engine)
    # the same prompts again: their prefixes come from the cache, block snapshots taken while decoding
    again = llm.generate(PROMPTS, PARAMS)
    assert engine.stats()["hit_tokens"] >= 200
    assert_same_outputs(tiny_checkpoint, again, want, prompts=PROMPTS, params=PARAMS)


def test_a_stop_token_ends_a_request_whose_next_step_is_already_running(tiny_checkpoint):
    params = SamplingParams(max_tokens=30, temperature=0.0)
    prompts = PROMPTS[:4]
    free = [c.token_ids for c in generate(tiny_checkpoint, prompts, params)[1]]
    # stop each request at its 6th token: the step after it is in flight when that token is seen
    stops = [SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(ids[5],)) for ids in free]
    want = generate(tiny_checkpoint, prompts, stops)[1]
    llm, got = generate(tiny_checkpoint, prompts, stops, async_scheduling=True)
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    assert_same_tokens(tiny_checkpoint, prompts, [c.token_ids for c in got], [c.token_ids for c in want], stops)
    assert all(len(c.token_ids) <= 6 for c in got)
    assert_nothing_held(llm.engine)


@pytest.mark.parametrize("compile", ["off", "trace"])
def test_async_survives_preemption_and_aborts(tiny_checkpoint, compile):
    engine = decode_tight_with_an_abort(tiny_checkpoint, compile=compile, graph_buckets=(8,), async_scheduling=True)
    if compile != "off":
        assert engine.runner.graphs.failures == 0 and engine.runner.graphs.replays > 0
    assert_nothing_held(engine)


def test_pushed_state_decodes_with_async_scheduling_on_both_sides(tiny_checkpoint):
    from test_disagg import WORK, assert_like_single_engine, pair, run, submit

    prefill, decode = pair(tiny_checkpoint, async_scheduling=True)
    for rid, (ids, params) in WORK.items():
        submit(prefill, decode, rid, ids, params)
    got, _ = run(prefill, decode, WORK)
    p, d = prefill.stats(), decode.stats()
    assert p["kv_pushed"] == d["kv_loaded"] == len(WORK) and d["kv_recomputed"] == 0
    assert_like_single_engine(tiny_checkpoint, WORK, got)


def test_async_scheduling_refuses_what_it_cannot_run():
    with pytest.raises(ConfigError, match="speculative"):
        EngineConfig(async_scheduling=True, speculative_tokens=1)
    with pytest.raises(ConfigError, match="true or false"):
        EngineConfig(async_scheduling="yes")
