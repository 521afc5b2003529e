"""Bounded replay (DeepSeek-V4.1, `EngineConfig.bounded_replay`) on the tiny checkpoint, against the plain
reference of `tests/v41_reference.py` run with the same cut (`ReferenceV41.logits(…, replay=…)`), in fp32.

The tiny model's window is 8 tokens and its last KV source layer 5 of 8: a prefill's layers 5–7 keep
each request's last 8 rows, and a prefix hit at h recomputes its last min(8, h) tokens. How far that
moves logits from the exact forward is measured by `python -m rackserve.bench.bounded_replay`; here
each path is pinned to the reference's reading of it, and shown to differ from the exact one.
"""

from __future__ import annotations

import pytest
import torch
from helpers import prompt, step

from rackserve.config import ConfigError, EngineConfig
from rackserve.engine.llm import LLM
from rackserve.engine.sampling import SamplingParams
from rackserve.engine.state_cache import StateCache
from rackserve.models import load_model, read_config

ATOL = 1e-4
W, BLOCK = 8, 8


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def model(v41_checkpoint):
    return load_model(v41_checkpoint)


def state_cache(model, prefix_caching: bool = False, bounded_replay: bool = True) -> StateCache:
    return StateCache(model.config, BLOCK, 4, 32 << 20, prefix_caching=prefix_caching, dtype=model.dtype,
                      bounded_replay=bounded_replay)


def test_the_tiny_model_cuts_at_its_last_kv_source(model):
    assert (model.config.replay_window, model.config.replay_layer) == (W, 5)
    assert state_cache(model).state.replay_window == W
    assert state_cache(model, bounded_replay=False).state.replay_window == 0


def test_a_prefill_runs_the_layers_from_the_cut_on_its_last_window(model, v41_reference):
    ids = prompt(63, seed=3)
    cache = state_cache(model)
    handle = cache.allocate()
    cache.reserve(handle, 60)
    batch = model.build_batch(cache.state, [(handle, ids[:60])])
    assert batch.replay.rows.tolist() == list(range(52, 60))
    got = torch.cat([step(model, cache, [(handle, ids[:60])])] +
                    [step(model, cache, [(handle, [t])]) for t in ids[60:]])  # and decode on after it
    want = v41_reference.logits(ids, replay={"kept_from": 60 - W})[59:]
    assert max_diff(got, want) < ATOL
    # it is the cut, not the exact forward
    assert max_diff(got, v41_reference.logits(ids)[59:]) > 1e-3


def test_rows_whose_logits_are_asked_for_are_kept(model):
    cache = state_cache(model)
    handle = cache.allocate()
    cache.reserve(handle, 30)
    batch = model.build_batch(cache.state, [(handle, prompt(30, seed=1))], num_logits=[12])
    assert batch.replay.rows.tolist() == list(range(18, 30))
    # a prompt no longer than the window is not cut
    assert model.build_batch(cache.state, [(handle, prompt(W, seed=1))]).replay is None


def test_a_prefix_hit_without_a_snapshot_replays_its_last_window(model, v41_reference):
    cache = state_cache(model, prefix_caching=True)
    first = prompt(40, seed=4)
    a = cache.allocate(first)
    step(model, cache, [(a, first)])
    cache.commit(a, first)  # blocks 0-4 cached, a snapshot at 40 only
    cache.free(a)
    ids = first[:20] + prompt(15, seed=5)  # shares blocks 0 and 1, neither with a snapshot
    pages = [p.clone() for p in cache.state.pieces()[1]]
    b = cache.allocate(ids)
    assert (b.num_tokens, b.window_from, b.entries_until) == (16 - W, 16 - W, 16)
    assert (cache.stats.hit_tokens, cache.stats.replayed_tokens) == (16 - W, W)
    got = step(model, cache, [(b, ids[b.num_tokens:])])
    want = v41_reference.logits(ids, replay={"window_from": 16 - W, "kept_from": len(ids) - W, "entries_until": 16})
    assert max_diff(got[0], want[-1]) < ATOL
    assert max_diff(got[0], v41_reference.logits(ids)[-1]) > 1e-3
    # the cached blocks' entries and keys stay as they were
    shared = torch.tensor(b.pages[:2])
    for before, after in zip(pages, cache.state.pieces()[1]):
        assert torch.equal(before[shared], after[shared])


def test_without_bounded_replay_a_hit_needs_a_snapshot(model):
    cache = state_cache(model, prefix_caching=True, bounded_replay=False)
    first = prompt(40, seed=4)
    a = cache.allocate(first)
    step(model, cache, [(a, first)])
    cache.commit(a, first)
    cache.free(a)
    assert cache.allocate(first[:20] + prompt(15, seed=5)).num_tokens == 0
    assert cache.allocate(first + prompt(3, seed=5)).num_tokens == 40  # the snapshot's block


def test_the_setting_is_the_family_default_and_refused_where_there_is_none(v41_checkpoint, tiny_checkpoint):
    v41, v4 = read_config(v41_checkpoint), read_config(tiny_checkpoint)
    assert EngineConfig().resolve(v41).bounded_replay is True
    assert EngineConfig(bounded_replay=False).resolve(v41).bounded_replay is False
    assert EngineConfig().resolve(v4).bounded_replay is False
    with pytest.raises(ConfigError, match="has no bounded replay"):
        EngineConfig(bounded_replay=True).resolve(v4)
    with pytest.raises(ConfigError, match="bounded_replay='yes' must be true, false, or omitted"):
        EngineConfig(bounded_replay="yes")


@pytest.mark.parametrize("replay, cached", [(True, 16 - W), (False, 0)])
def test_the_engine_reuses_a_block_without_a_snapshot(v41_checkpoint, replay, cached):
    """Two conversations sharing a first block that ends where neither prompt did: with bounded replay the
    second reuses it (recomputing the window before its end); without, only a snapshot's block is a hit."""
    llm = LLM(v41_checkpoint, bounded_replay=replay, block_size=16)
    first = prompt(40, seed=6)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert llm.generate(first, params)[0].num_cached_tokens == 0
    [again] = llm.generate(first[:20] + prompt(12, seed=7), params)
    assert again.num_cached_tokens == cached and len(again.token_ids) == 4
    assert llm.engine.cache.stats.replayed_tokens == (W if replay else 0)


def test_async_scheduling_gives_the_same_tokens_with_bounded_replay(v41_checkpoint):
    """Prefills that are cut run beside decodes whose token is written on the device after the batch was
    built (async scheduling): the kept rows read it too."""
    prompts = [prompt(n, seed=20 + n) for n in (40, 9, 70, 25)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [c.token_ids for c in LLM(v41_checkpoint, max_num_batched_tokens=48).generate(prompts, params)]
    llm = LLM(v41_checkpoint, max_num_batched_tokens=48, async_scheduling=True)
    assert [c.token_ids for c in llm.generate(prompts, params)] == want
