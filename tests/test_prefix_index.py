"""Block events, the bounded prefix index, its journal and replicas, and the cache-aware cost (no Ray)."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from helpers import prompt
from rackserve.cluster.prefix_index import ENTRY_BYTES, BlockJournal, IndexReplica, PrefixIndex
from rackserve.cluster.request_router import RequestRouter, RoutingConfig
from rackserve.config import ConfigError
from rackserve.engine.block_events import BlockLog, chain_hash, prefix_keys
from rackserve.engine.state_cache import StateCache
from rackserve.messages import BlockDelta, RankLoad
from rackserve.models.deepseek_v4.config import ModelConfig
from rackserve.models.deepseek_v4.state import ModelState
from rackserve.models.deepseek_v4.tiny import TINY_CONFIG
from rackserve.serve.config import ServeConfig

CONFIG = ModelConfig.from_dict(TINY_CONFIG)
BLOCK = 16
pytestmark = pytest.mark.timeout(120)


def small_cache(pages: int) -> StateCache:
    probe = ModelState(CONFIG, 1, 1, BLOCK, device="meta")
    return StateCache(CONFIG, BLOCK, 2, 4 * probe.slot_bytes + pages * probe.page_bytes, max_snapshots=2)


def run(cache: StateCache, tokens: list[int]) -> None:
    """A request that computed `tokens` and finished (its full blocks stay cached)."""
    handle = cache.allocate(tokens)
    assert handle is not None and cache.reserve(handle, len(tokens))
    handle.num_tokens = len(tokens)
    cache.commit(handle, tokens)
    cache.free(handle)


def test_a_cache_logs_the_blocks_it_stores_and_evicts_under_the_keys_a_router_computes():
    cache = small_cache(pages=4)
    a, b = prompt(48, seed=1), prompt(48, seed=2)
    first = cache.events.since(None)  # a new reader: a reset, of nothing yet
    assert first.reset and first.stored == ()
    run(cache, a)
    delta = cache.events.since(first.seq)
    assert not delta.reset and list(delta.stored) == prefix_keys(a, BLOCK) and delta.removed == ()
    run(cache, b)  # 3 more blocks in 4 pages: two of a's are evicted, its last first (its head still serves)
    delta = cache.events.since(delta.seq)
    assert list(delta.stored) == prefix_keys(b, BLOCK) and list(delta.removed) == prefix_keys(a, BLOCK)[:0:-1]
    assert cache.events.since(delta.seq) == BlockDelta((), (), delta.seq)  # nothing since
    # a reader that lost track (or a new one) gets every block held
    again = cache.events.since(None)
    assert again.reset and sorted(again.stored) == sorted(prefix_keys(a, BLOCK)[:1] + prefix_keys(b, BLOCK))
    # the tokens a lookup would reuse, nothing taken: the blocks up to the last snapshot
    assert cache.cached_tokens(b + [5]) == 48 and cache.cached_tokens(prompt(40, seed=3)) == 0


def test_a_log_nobody_reads_stays_bounded_and_its_next_reader_gets_a_reset():
    held = [chain_hash(b"", [i]) for i in range(3)]
    log = BlockLog(lambda: held, max_events=100)
    seq = log.since(None).seq
    for i in range(1000):
        log.stored(chain_hash(b"x", [i]))
    assert len(log._events) <= 100
    delta = log.since(seq)
    assert delta.reset and len(delta.stored) == 3 and delta.seq == 1000
    log.stored(held[0]), log.removed(held[0])  # stored then evicted: its last event counts
    last = log.since(delta.seq)
    assert last.removed == (prefix_keys([0], 1)[0],) and last.stored == ()


def test_the_index_says_how_deep_each_cache_holds_a_prompt():
    keys = list(range(10, 20))
    index = PrefixIndex(3)
    index.apply(0, BlockDelta(tuple(keys[:6])))
    index.apply(1, BlockDelta(tuple(keys[:2] + keys[3:])))  # a hole at block 2: only 2 usable
    index.apply(2, BlockDelta(tuple(keys)))
    assert index.match(keys) == [6, 2, 10] and index.match([99] + keys) == [0, 0, 0]
    index.apply(2, BlockDelta(removed=tuple(keys[4:])))
    assert index.match(keys) == [6, 2, 4] and [index.held(c) for c in range(3)] == [6, 9, 4]
    index.apply(0, BlockDelta((keys[0],), reset=True))  # a restarted cache: what it holds now
    assert index.match(keys) == [1, 2, 4]


def test_millions_of_blocks_leave_the_index_within_its_bound():
    """Whatever the traffic, the index holds at most `max_entries` keys; each costs about ENTRY_BYTES."""
    cap = 1 << 16
    rng = random.Random(0)
    index = PrefixIndex(6, max_entries=cap, ranks=4)
    for step in range(2000):  # 2M blocks stored across six caches, a tenth of them evicted again
        stored = tuple(rng.getrandbits(64) for _ in range(1000))
        index.apply(step % 6, BlockDelta(stored, stored[:100]))
    assert index.size <= cap and len(index.dump()[3]) == index.size
    assert sum(index.held(c) for c in range(6)) >= index.size  # every entry is some cache's
    # what a full index costs, per entry
    tracemalloc.start()
    try:
        full = PrefixIndex(6, max_entries=cap, ranks=4)
        for i in range(cap // 1000 + 1):  # filled, the deltas' tuples gone, their keys held
            full.apply(i % 6, BlockDelta(tuple(rng.getrandbits(64) for _ in range(1000))))
        size, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    per_entry = size / full.size
    assert full.size == cap and 0.7 * ENTRY_BYTES < per_entry < 1.3 * ENTRY_BYTES, per_entry


def test_replicas_that_follow_the_journal_hold_the_owners_index_and_route_alike():
    ranks = [("d0", 0), ("d1", 0), ("p0", 0), ("p1", 0)]
    journal = BlockJournal(len(ranks) + 1, max_entries=500, ranks=len(ranks), journal_keys=300)
    early, late = IndexReplica(5, ranks=4), IndexReplica(5, ranks=4)
    early.apply(journal.feed(early.seq))  # a dump of nothing
    rng = random.Random(1)
    for step in range(60):
        cache = rng.randrange(5)
        journal.add(cache, BlockDelta(tuple(rng.getrandbits(20) for _ in range(20)),
                                      tuple(rng.getrandbits(20) for _ in range(3))))
        early.apply(journal.feed(early.seq))  # deltas
        if step == 30:
            late.apply(journal.feed(late.seq))  # a dump; then behind by more than the journal keeps
    late.apply(journal.feed(late.seq))
    assert early.index.dump() == late.index.dump() == journal.index.dump()
    assert early.index.size <= 500
    # with the same loads, two routers over them choose alike
    routers = []
    for replica in (early, late):
        router = RequestRouter(ranks[:2], ranks[2:], stores=1, block_size=BLOCK)
        router.index, router.rank_store = replica, {r: 0 for r in ranks}
        router.update({r: RankLoad(tokens=10 * i, prefill_tokens=i, cache_blocks=200) for i, r in enumerate(ranks)})
        routers.append(router)
    held = [k for k, _ in journal.index.dump()[3]]
    for i in range(50):
        keys = held[i:i + 4]
        picks = [(r.decode_rank(None, 100, keys=keys, prompt_tokens=64), r.prefill_rank(None, 64, keys)) for r in routers]
        assert picks[0] == picks[1]


def test_history_stays_where_it_is_cached_and_new_prefixes_go_to_the_cache_with_room():
    """Two prefill ranks hold the same tool prefix; rank 0 is full and most new blocks have gone to it
    lately, rank 1 has room. A turn whose history rank 0 holds goes there (it saves most); a new
    conversation, sharing only the tools, goes to rank 1, where its blocks evict nothing."""
    decode, prefill = [("d", 0)], [("p", 0), ("p", 1)]
    router = RequestRouter(decode, prefill, stores=0, block_size=BLOCK)
    tools, history = list(range(100, 120)), list(range(200, 260))
    index = router.index.index
    index.apply(2, BlockDelta(tuple(tools)))
    index.apply(1, BlockDelta(tuple(tools + history)))  # rank 0 (cache 1) takes 60 new blocks more
    router.update({decode[0]: RankLoad(), prefill[0]: RankLoad(cache_blocks=80), prefill[1]: RankLoad(cache_blocks=400)})
    assert router.pressure(prefill[0], prefill) > 0.9 > 0.1 > router.pressure(prefill[1], prefill)
    turn = tools + history + [300, 301]
    assert router.prefill_rank(None, len(turn) * BLOCK, turn) == prefill[0]
    router.update({decode[0]: RankLoad(), prefill[0]: RankLoad(cache_blocks=80), prefill[1]: RankLoad(cache_blocks=400)})
    fresh = tools + list(range(400, 410))
    assert router.prefill_rank(None, len(fresh) * BLOCK, fresh) == prefill[1]
    # least-loaded routing sees none of it: the lighter rank, whatever it holds
    router.config = RoutingConfig(policy="least_loaded")
    router.update({decode[0]: RankLoad(), prefill[0]: RankLoad(prefill_tokens=0), prefill[1]: RankLoad(prefill_tokens=5)})
    assert router.prefill_rank(None, len(fresh) * BLOCK, fresh) == prefill[0]


def test_turnover_decays_as_new_blocks_go_elsewhere_and_a_dump_keeps_it():
    index = PrefixIndex(2)
    index.apply(0, BlockDelta(tuple(range(100))))
    busy = index.turnover(0)
    index.apply(1, BlockDelta(tuple(range(1000, 1400))))
    assert index.turnover(0) < busy / 2 < index.turnover(1)
    copy = PrefixIndex.load(index.dump())
    assert [copy.turnover(c) for c in (0, 1)] == [index.turnover(c) for c in (0, 1)]
    index.apply(1, BlockDelta(tuple(range(1000, 1400)), reset=True))  # a reset lists old blocks: no turnover
    assert index.turnover(1) == copy.turnover(1)


def test_routing_settings_are_checked_where_they_are_given():
    with pytest.raises(ConfigError, match="policy='nearest'"):
        RoutingConfig(policy="nearest")
    with pytest.raises(ConfigError, match="memory_weight=-1"):
        RoutingConfig(memory_weight=-1)
    with pytest.raises(ConfigError, match=r"unknown routing setting\(s\) \['wieght'\]"):
        ServeConfig(routing={"wieght": 1})
    assert ServeConfig(routing={"policy": "session"}).routing == {"policy": "session"}
