"""Decode on fixed shapes (`EngineConfig.compile`, `rackserve.engine.graphs`): the padded decode forward
is one graph without breaks, and an engine running it gives what the eager engine gives, for ragged
greedy and seeded workloads, speculative verify passes, P/D decode, preemption and aborts. "trace"
runs the traced graph without code generation (seconds); one test compiles with inductor."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest
import torch

from helpers import assert_same_tokens, prompt
from rackserve.config import ConfigError, EngineConfig
from rackserve.engine import LLM, SamplingParams
from rackserve.engine.graphs import _leaves
from rackserve.models.deepseek_v4.config import CSA, HCA
from rackserve.models.deepseek_v4.tiny import make_tiny
from rackserve.models.interface import StaticShape

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
# ragged: prompts across window, compression and block boundaries, different output lengths, one sampled
PROMPTS = [prompt(n, seed=400 + n) for n in (3, 17, 40, 64, 129, 200)]
PARAMS = [SamplingParams(max_tokens=m, temperature=t, seed=5, ignore_eos=True, logprobs=2)
          for m, t in [(24, 0.0), (9, 0.0), (30, 0.0), (16, 0.8), (21, 0.0), (12, 0.0)]]


def generate(checkpoint, **kwargs):
    # few shapes, so the suite traces few: 1-2 pages of 128 tokens, 8 token rows (32 with drafts)
    llm = LLM(checkpoint, max_num_seqs=8, block_size=128, graph_buckets=(8, 32), **kwargs)
    return llm, llm.generate(PROMPTS, PARAMS)


def assert_same_outputs(checkpoint, got, want, tol: float = 1e-5, prompts=PROMPTS, params=PARAMS) -> None:
    """Same tokens (up to near-ties, `assert_same_tokens`) and, where equal, logprobs within `tol`."""
    assert_same_tokens(checkpoint, prompts, [c.token_ids for c in got], [c.token_ids for c in want], params)
    for g, w in zip(got, want):
        for a, b in zip(g.logprobs, w.logprobs):
            if a.token_id != b.token_id:
                break
            assert abs(a.logprob - b.logprob) <= tol
            assert [t for t, _ in a.top] == [t for t, _ in b.top] or abs(a.top[0][1] - a.top[1][1]) <= tol
            assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top)) <= tol


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny model with two layers (HCA then CSA, each with its window; hash then learned routing) and
    its MTP layer: every kind of state, and half the tracing of the five-layer one."""
    return make_tiny(tmp_path_factory.mktemp("two-layers"), config={
        "num_hidden_layers": 2, "layer_types": [HCA, CSA], "mlp_layer_types": ["hash_moe", "moe"]})


@pytest.fixture(scope="module")
def eager(checkpoint):
    return generate(checkpoint)[1]


def fixed_shape_batches(llm, lengths: Sequence[int]) -> tuple[StaticShape, object, object]:
    """One step of `llm`'s engine (compile on) over prompts of `lengths`, then the next decode pass of its
    running requests built for its fixed shape, and that of the first request alone on the same shape:
    (the shape, the batch, the one-request batch)."""
    engine = llm.engine
    for n in lengths:
        engine.add_request(prompt(n, seed=n), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    engine.step()
    requests = [(r.handle, [r.token_ids[-1]]) for r in engine.scheduler.running]
    for handle, _ in requests:
        engine.cache.reserve(handle, 1)
    shape = engine.runner.graphs.shape_for(requests)
    batches = [engine.model.build_batch(engine.cache.state, r, static=shape, scratch=engine.runner.dummy)
               for r in (requests, requests[:1])]
    return shape, *batches


def assert_one_graph(llm, batch) -> None:
    """The model's fixed-shape forward of `batch` traces as one graph without breaks."""
    with torch.no_grad():
        explained = torch._dynamo.explain(llm.engine.model.static_forward)(batch, llm.engine.cache.state)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons


def test_the_padded_decode_forward_is_one_graph_without_breaks(checkpoint):
    llm = LLM(checkpoint, max_num_seqs=4, prefix_caching=False, compile="trace")
    shape, batch, other = fixed_shape_batches(llm, (5, 33, 70))
    assert shape == StaticShape(4, 8)  # 70 tokens + 1 in pages of 16 -> 5 pages -> bucket 8
    assert_one_graph(llm, batch)
    # the batch's shapes depend on the shape alone, not on the requests
    assert [t.shape for t in _leaves(batch)] == [t.shape for t in _leaves(other)]


def test_traced_decode_equals_eager_on_a_ragged_workload(checkpoint):
    # on quantised state (FP8 entries, FP4 indexer keys); the other tests run the model dtype's
    want = generate(checkpoint, state_dtype="fp8-fp4")[1]
    llm, got = generate(checkpoint, compile="trace", state_dtype="fp8-fp4")
    graphs = llm.engine.runner.graphs
    assert graphs.failures == 0 and graphs.replays >= 25  # every decode step
    assert {s.tokens for _, s in graphs.shapes} == {8}
    assert_same_outputs(checkpoint, got, want)


def test_traced_verify_passes_equal_eager_with_three_drafts(checkpoint, eager):
    llm, got = generate(checkpoint, compile="trace", speculative_tokens=3)
    graphs = llm.engine.runner.graphs
    assert graphs.failures == 0 and graphs.replays > 10
    # verify passes: 1 + 3 tokens per request
    assert 32 in {s.tokens for fn, s in graphs.shapes if fn == "static_forward"}
    # the draft layer's forwards too: following the main model's tokens, and drafting
    assert {fn for fn, _ in graphs.shapes} == {"static_forward", "static_follow", "static_draft"}
    assert_same_outputs(checkpoint, got, eager)
    assert llm.engine.stats()["spec_drafts"] > 0


def decode_tight_with_an_abort(checkpoint, **kwargs):
    """Six requests under a state budget that makes them preempt each other, and a seventh aborted
    after its 5th token (mid-stream, its state in the step's passes); `kwargs`: the engine's settings
    beyond those. Checks the six get what a roomy engine gives and the seventh no more; returns the
    engine."""
    from test_engine import _bytes_for

    sizes = dict(max_num_seqs=6, max_num_batched_tokens=256, max_model_len=192, block_size=16)
    prompts = [prompt(90 + 7 * i, seed=200 + i) for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = [c.token_ids for c in LLM(checkpoint, **sizes).generate(prompts, params)]
    # 20 pages (one may be the scratch request's, and so one more slot): the six together need ~50
    slot = _bytes_for(sizes, checkpoint, pages=0) / (2 * sizes["max_num_seqs"])
    engine = LLM(checkpoint, state_memory_mb=_bytes_for(sizes, checkpoint, pages=20) + slot, **sizes, **kwargs).engine
    ids = [engine.add_request(p, params).request_id for p in prompts]
    extra = engine.add_request(prompt(50, seed=9), params).request_id
    tokens = {rid: [] for rid in [*ids, extra]}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        if len(tokens[extra]) == 5:
            engine.abort(extra)
    assert engine.stats()["preemptions"] > 0
    assert len(tokens[extra]) == 5
    assert_same_tokens(checkpoint, prompts, [tokens[r] for r in ids], want, params)
    return engine


def test_traced_decode_survives_preemption_and_aborts(checkpoint):
    engine = decode_tight_with_an_abort(checkpoint, compile="trace", graph_buckets=(8,))
    assert engine.runner.graphs.failures == 0


def test_pushed_state_decodes_on_traced_graphs_like_the_single_engine(checkpoint):
    from test_disagg import WORK, assert_like_single_engine, pair, run, submit

    prefill, decode = pair(checkpoint, compile="trace", graph_buckets=(8,), block_size=128)
    for rid, (ids, params) in WORK.items():
        submit(prefill, decode, rid, ids, params)
    got, _ = run(prefill, decode, WORK)
    assert decode.runner.graphs.replays > 0 and decode.runner.graphs.failures == 0
    assert decode.stats()["kv_recomputed"] == 0
    assert_like_single_engine(checkpoint, WORK, got)


@pytest.mark.slow
def test_inductor_compiled_decode_equals_eager(tmp_path_factory):
    """The real compiler (C++ code from inductor), on a 1-layer model (CSA: sliding window, compressor,
    indexer, learned routing; the other kinds are its parts), on one shape (8 token rows, 2 pages), so
    the suite pays one small compile."""
    path = make_tiny(tmp_path_factory.mktemp("one-layer"), config={
        "num_hidden_layers": 1, "layer_types": [CSA], "mlp_layer_types": ["moe"]})
    kwargs = dict(max_num_seqs=8, max_model_len=256, block_size=128, prefix_caching=False)
    prompts = [prompt(130 + 9 * i, seed=600 + i) for i in range(6)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=3)
    want = LLM(path, **kwargs).generate(prompts, params)
    llm = LLM(path, compile="on", graph_buckets=(8,), **kwargs)
    got = llm.generate(prompts, params)
    graphs = llm.engine.runner.graphs
    assert list(graphs.shapes) == [("static_forward", StaticShape(8, 2))]
    assert graphs.failures == 0 and graphs.replays >= 19
    assert_same_outputs(path, got, want, prompts=prompts, params=params)


def test_a_shape_that_fails_to_compile_runs_eager_with_a_warning(checkpoint, eager, monkeypatch, caplog):
    def broken(*args, **kwargs):  # the injected fault: the compiler is unavailable
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch, "compile", broken)
    with caplog.at_level(logging.WARNING, logger="rackserve.engine.graphs"):
        llm, got = generate(checkpoint, compile="on")
    assert llm.engine.runner.graphs.failures == len(llm.engine.runner.graphs.shapes) > 0
    assert "runs eager: torch.compile failed (RuntimeError: no C++ compiler found)" in caplog.text
    assert_same_outputs(checkpoint, got, eager)


def test_compile_settings_are_checked():
    with pytest.raises(ConfigError, match="compile='fast' must be one of"):
        EngineConfig(compile="fast")
    with pytest.raises(ConfigError, match="graph_buckets=.* must be a list of positive"):
        EngineConfig(graph_buckets=[0, 8])
    assert EngineConfig(graph_buckets=[32, 8, 8]).graph_buckets == (8, 32)
