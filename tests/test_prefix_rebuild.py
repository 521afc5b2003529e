"""A DeepSeek-V4 prefix hit at every cached block, exactly: a hit ending at a block without a snapshot
replays the last `rebuild_tokens` tokens before it over the cached pages (entries kept, windows and
carry rebuilt), and the logits and outputs equal those of a run without the cache.

The tiny model has 5 layers and a 16-token window: layer l's input at a replayed position is exact
once 15·l positions before it were replayed, and its slot rows span 16 positions, so 4·15 + 16 = 76
tokens (80, whole blocks) rebuild every slot row.
"""

from __future__ import annotations

import pytest
import torch
from helpers import prompt, step

from rackserve.engine.llm import LLM
from rackserve.engine.sampling import SamplingParams
from rackserve.engine.state_cache import StateCache
from rackserve.models import load_model

BLOCK, REBUILD = 16, 80
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(tiny_checkpoint)


def cached(model, first: list[int], exact_rebuild: bool = True, snapshots: int = 0) -> StateCache:
    """A cache holding `first`'s blocks (a snapshot at its end only when `snapshots`)."""
    cache = StateCache(model.config, BLOCK, 4, 64 << 20, dtype=model.dtype, max_snapshots=snapshots,
                       exact_rebuild=exact_rebuild)
    a = cache.allocate(first)
    step(model, cache, [(a, first)])
    cache.commit(a, first)
    cache.free(a)
    return cache


def uncached_logits(model, ids: list[int]) -> torch.Tensor:
    cache = StateCache(model.config, BLOCK, 1, 64 << 20, prefix_caching=False, dtype=model.dtype)
    return step(model, cache, [(cache.allocate(), ids)])[0]


def test_a_hit_without_a_snapshot_rebuilds_the_slot_exactly(model):
    first = prompt(400, seed=4)
    ids = first[:330] + prompt(15, seed=5)  # shares 20 blocks, and 10 tokens of the 21st
    cache = cached(model, first)
    assert cache.state.rebuild_tokens == REBUILD
    pages = [p.clone() for p in cache.state.pieces()[1]]
    assert cache.cached_tokens(ids) == 320 - REBUILD  # what a rank weighs against a KV store's hit
    b = cache.allocate(ids)
    assert (b.num_tokens, b.window_from, b.entries_until) == (320 - REBUILD, 320 - REBUILD, 320)
    assert (cache.stats.hit_tokens, cache.stats.replayed_tokens) == (320 - REBUILD, REBUILD)
    got = step(model, cache, [(b, ids[b.num_tokens:])])[0]
    assert (got - uncached_logits(model, ids)).abs().max().item() < 1e-4
    shared = torch.tensor(b.pages[:20])  # the cached blocks' entries and keys stay as they were
    for before, after in zip(pages, cache.state.pieces()[1], strict=True):
        assert torch.equal(before[shared], after[shared])


def test_a_rebuild_prefilled_in_chunks_shorter_than_it_is_exact_too(model):
    """A step's token budget may cut the replay into chunks that end before the cached entries do."""
    first = prompt(400, seed=4)
    ids = first[:330] + prompt(15, seed=5)
    cache = cached(model, first)
    b = cache.allocate(ids)
    while len(ids) - b.num_tokens > BLOCK:
        step(model, cache, [(b, ids[b.num_tokens:b.num_tokens + BLOCK])])
    got = step(model, cache, [(b, ids[b.num_tokens:])])[0]
    assert (got - uncached_logits(model, ids)).abs().max().item() < 1e-4


def test_a_shorter_replay_than_the_receptive_field_is_not_exact(model):
    """What the bound is for: rebuilding from a block before the hit leaves the deep layers' windows wrong."""
    first = prompt(400, seed=4)
    ids = first[:330] + prompt(15, seed=5)
    cache = cached(model, first)
    cache._replay_tokens = BLOCK
    b = cache.allocate(ids)
    got = step(model, cache, [(b, ids[b.num_tokens:])])[0]
    assert (got - uncached_logits(model, ids)).abs().max().item() > 1e-3


def test_a_closer_snapshot_wins_and_a_kv_store_needs_one(model):
    first = prompt(320, seed=6)
    ids = first + prompt(20, seed=7)
    # a snapshot at 320: resuming there recomputes nothing of the prefix
    assert cached(model, first, snapshots=2).allocate(ids).num_tokens == 320
    # no snapshot: rebuilt at 320
    assert cached(model, first).allocate(ids).num_tokens == 320 - REBUILD
    # a cache that does not run the model (a KV store's) only resumes at snapshots
    assert cached(model, first, exact_rebuild=False).allocate(ids).num_tokens == 0
    # a hit shorter than the rebuild saves nothing
    short = first[:64] + prompt(20, seed=8)
    assert cached(model, first).allocate(short).num_tokens == 0


def test_prompts_diverging_mid_block_run_share_every_full_block_with_equal_outputs(tiny_checkpoint):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    llm = LLM(tiny_checkpoint, max_num_batched_tokens=512)
    plain = LLM(tiny_checkpoint, max_num_batched_tokens=512, prefix_caching=False)
    tools = prompt(330, seed=9)  # a shared prefix ending mid-block, as tool definitions do
    a, b = tools + prompt(70, seed=10), tools + prompt(25, seed=11)
    llm.generate([a], params)
    [got] = llm.generate([b], params)
    [want] = plain.generate([b], params)
    assert got.num_cached_tokens == 320 - REBUILD  # every full block of the shared prefix, 80 tokens rebuilt
    assert got.token_ids == want.token_ids
    assert [x.logprob for x in got.logprobs] == pytest.approx([x.logprob for x in want.logprobs], abs=1e-4)


def test_conversations_resume_at_their_latest_turn_while_every_snapshot_is_held(tiny_checkpoint):
    # three conversations run side by side; each turn's prompt resumes where the last one's ended. With
    # 4 snapshot slots, the snapshots along the running requests' chains fill them all (none evictable):
    # the newest boundary frees the one nearest before it in its own chain, so no hit has to replay
    llm = LLM(tiny_checkpoint, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024, prefix_snapshots=4)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    histories = [prompt(64, seed=10 + c) for c in range(3)]
    for turn in range(5):
        for c, h in enumerate(histories):
            h += prompt(48, seed=100 * c + turn)
        sent = [list(h) for h in histories]
        outs = llm.generate(sent, greedy)
        for h, o in zip(histories, outs):
            h += o.token_ids
        if turn:  # the answer's 16 tokens (its last one never ran) and the 48 new ones
            assert [len(p) - o.num_cached_tokens for p, o in zip(sent, outs)] == [64] * 3
    assert llm.engine.stats()["replayed_tokens"] == 0
