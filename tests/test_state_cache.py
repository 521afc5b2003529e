"""StateCache: allocation that waits instead of failing, page sharing, snapshots, LRU eviction, counters."""

from __future__ import annotations

import pytest

from helpers import prompt
from rackserve.models.deepseek_v4.config import ModelConfig
from rackserve.engine.state_cache import StateCache
from rackserve.models.deepseek_v4.state import ModelState
from rackserve.models.deepseek_v4.tiny import TINY_CONFIG

CONFIG = ModelConfig.from_dict(TINY_CONFIG)
BLOCK = 16


def cache_with(requests: int, pages: int, snapshots: int = 2, prefix_caching: bool = True) -> StateCache:
    probe = ModelState(CONFIG, 1, 1, BLOCK, device="meta")
    slots = requests + (snapshots if prefix_caching else 0)
    budget = slots * probe.slot_bytes + pages * probe.page_bytes
    cache = StateCache(CONFIG, BLOCK, requests, budget, prefix_caching=prefix_caching, max_snapshots=snapshots)
    assert cache.num_pages == pages
    return cache


def fill(cache: StateCache, tokens: list[int]):
    """A request that has 'computed' `tokens` (state contents are irrelevant to the bookkeeping)."""
    handle = cache.allocate(tokens)
    assert handle is not None and cache.reserve(handle, len(tokens))
    handle.num_tokens = len(tokens)
    cache.commit(handle, tokens)
    return handle


def test_allocation_waits_instead_of_failing():
    cache = cache_with(requests=2, pages=3, prefix_caching=False)
    a, b = cache.allocate(), cache.allocate()
    assert cache.allocate() is None
    assert cache.reserve(a, 32) and len(a.pages) == 2
    assert not cache.reserve(b, 32) and b.pages == []  # 2 pages needed, 1 free: nothing is taken
    assert cache.reserve(b, 16)
    assert cache.bytes_in_use == cache.bytes_total
    cache.free(a)
    assert cache.allocate() is not None and cache.reserve(b, 48)


def test_budget_too_small_names_the_fix():
    with pytest.raises(ValueError, match="raise the state memory"):
        StateCache(CONFIG, BLOCK, max_requests=4, budget_bytes=1000)


def test_a_repeated_prefix_shares_pages_and_restores_the_snapshot():
    cache = cache_with(requests=3, pages=10)
    tokens = prompt(40, seed=0)  # 2 full blocks, ends mid-block: no snapshot at its end
    first = fill(cache, tokens[:32])  # sits on a boundary: snapshot of block 2
    assert cache.stats.snapshots == 1
    cache.free(first)
    second = cache.allocate(tokens)
    assert second.num_tokens == 32 and cache.stats.hits == 1 and cache.stats.hit_tokens == 32
    shared = list(second.pages)
    # the snapshot's window/carry were copied into the new slot
    for t in cache.state.pieces()[0]:
        assert t[second.slot].equal(t[cache._blocks[second.block_hashes[-1]].snapshot])
    third = cache.allocate(tokens)
    assert third.pages == shared  # the same pages, held twice
    assert cache.reserve(third, 40) and third.pages[:2] == shared and third.pages[2] not in shared
    cache.free(second)
    cache.free(third)
    # everything is back, except what the cache keeps: 2 pages, 1 snapshot slot
    assert cache.bytes_in_use == 2 * cache.state.page_bytes + cache.state.slot_bytes


def test_the_last_token_is_always_computed():
    cache = cache_with(requests=2, pages=10)
    tokens = prompt(32, seed=1)
    handle = fill(cache, tokens[:16])
    assert cache.reserve(handle, 32)
    handle.num_tokens = 32
    cache.commit(handle, tokens)
    assert cache.stats.snapshots == 2  # at 16 and at 32
    cache.free(handle)
    again = cache.allocate(tokens)  # an exact repeat: block 2 would cover the last token
    assert again.num_tokens == 16


def test_least_recently_used_blocks_are_evicted_first():
    cache = cache_with(requests=2, pages=4, snapshots=4)
    old, new = prompt(32, seed=2), prompt(32, seed=3)
    cache.free(fill(cache, old))
    cache.free(fill(cache, new))
    assert cache.stats.evictions == 0
    big = cache.allocate()
    assert cache.reserve(big, 32)  # needs 2 of the 4 pages, all cached: evicts `old`'s two
    assert cache.stats.evictions == 2
    assert cache.allocate(old + [1]).num_tokens == 0
    assert cache.allocate(new + [1]).num_tokens == 32


def test_pages_in_use_are_never_evicted():
    cache = cache_with(requests=3, pages=2)
    holder = fill(cache, prompt(32, seed=4))
    other = cache.allocate()
    assert not cache.reserve(other, 16)  # both pages belong to a running request
    assert cache.stats.evictions == 0 and holder.pages


def test_at_the_snapshot_limit_each_conversation_keeps_its_newest_turn_end():
    """Conversations resumed turn after turn pile snapshots along their chains; once they reach the
    limit, the least recently used go (older turns' ends), never the turn end just taken, though its
    block is the one a freed request leaves oldest among its pages."""
    cache = cache_with(requests=2, pages=60, snapshots=4)
    history = {c: prompt(32, seed=10 + c) for c in range(2)}
    for turn in range(5):
        for c in history:
            handle = cache.allocate(history[c] + [1])
            if turn:  # the previous turn's end, its snapshot kept
                assert handle.num_tokens == len(history[c]), (turn, c)
            history[c] = history[c] + prompt(16, seed=100 * turn + c)
            assert cache.reserve(handle, len(history[c]))
            handle.num_tokens = len(history[c])
            cache.commit(handle, history[c])
            cache.free(handle)
    assert len(cache._snapshots) == 4 and cache.stats.evictions >= 6
