"""The disk tier under a host prefix cache: evicted blocks come back byte for byte, the disk's bytes
are bounded (least recently spilled first, its removals reported), a damaged file is a miss, a
failing disk degrades to memory only; and through a KV store, a working set larger than its memory
is served from disk with outputs equal to the single engine's."""

from __future__ import annotations

import errno
import gc
import itertools
import logging
import weakref

import pytest
import torch
from helpers import prompt

from rackserve.config import ConfigError
from rackserve.engine.block_events import block_key, chain_hash
from rackserve.engine.disk_tier import DiskTier
from rackserve.engine.prefix_store import PrefixStore
from rackserve.engine.state_cache import StateCache
from rackserve.engine import SamplingParams
from rackserve.models.deepseek_v4.config import ModelConfig
from rackserve.models.deepseek_v4.state import ModelState
from rackserve.models.deepseek_v4.tiny import TINY_CONFIG
from rackserve.serve.config import ServeConfig
from rackserve.transfer.local import LocalAgent
from test_disagg import assert_like_single_engine, pair, run_with_store, submit

CONFIG = ModelConfig.from_dict(TINY_CONFIG)
BLOCK = 16
_names = itertools.count()


def cache_on_disk(tmp_path, pages: int, disk_bytes: int = 1 << 20) -> StateCache:
    """A cache of 1 request slot, 4 snapshots and `pages` pages over a disk tier of `disk_bytes`."""
    probe = ModelState(CONFIG, 1, 1, BLOCK, device="meta")
    cache = StateCache(CONFIG, BLOCK, 1, 5 * probe.slot_bytes + pages * probe.page_bytes, max_snapshots=4)
    cache.attach_lower(DiskTier(tmp_path / "disk", disk_bytes, on_removed=cache.events.removed))
    return cache


def fill(cache: StateCache, tokens: list[int], seed: int) -> list[torch.Tensor]:
    """A request that computed `tokens` (random state contents), freed; its blocks' bytes."""
    handle = cache.allocate(tokens)
    assert handle is not None and cache.reserve(handle, len(tokens))
    g = torch.Generator().manual_seed(seed)
    for t in cache.state.pieces()[0]:
        t[handle.slot] = torch.randn(t[handle.slot].shape, generator=g).to(t.dtype)
    for t in cache.state.pieces()[1]:
        for page in handle.pages:
            t[page] = torch.randn(t[page].shape, generator=g).to(t.dtype)
    handle.num_tokens = len(tokens)
    cache.commit(handle, tokens)
    blocks = [cache.state.block_bytes(page, None) for page in handle.pages]
    blocks[-1] = cache.state.block_bytes(handle.pages[-1], handle.slot)  # the last block has its snapshot
    cache.free(handle)
    return blocks


def test_blocks_evicted_to_disk_come_back_byte_for_byte(tmp_path):
    cache = cache_on_disk(tmp_path, pages=4)
    disk = cache.lower
    old, new = prompt(32, seed=1), prompt(64, seed=2)
    want = fill(cache, old, seed=1)
    fill(cache, new, seed=2)  # 4 pages: `old`'s 2 go to disk
    assert disk.flush() and disk.stats.spills == 2 and len(list(disk.path.glob("*.blk"))) == 2
    held = set(cache.events.since(None).stored)  # what routers are told: host and disk alike
    assert {block_key(h) for h in disk.keys()} <= held and len(held) == 6

    handle = cache.allocate(old + [7])  # reads `old` back (evicting `new`'s oldest to disk)
    assert handle.num_tokens == 32 and cache.stats.promoted == 2 and disk.stats.hits == 2
    snapshot = cache._blocks[handle.block_hashes[-1]].snapshot
    assert cache.state.block_bytes(handle.pages[0], None).equal(want[0])
    assert cache.state.block_bytes(handle.pages[1], snapshot).equal(want[1])
    for t in cache.state.pieces()[0]:  # the request starts from the snapshot read back
        assert t[handle.slot].equal(t[snapshot])
    assert not set(disk.keys()) & set(handle.block_hashes)  # exclusive tiers: a block lives in one
    cache.free(handle)
    disk.close()
    assert not disk.path.exists()


def test_the_disk_holds_its_bytes_at_most_dropping_the_oldest_and_saying_so(tmp_path):
    removed = []
    disk = DiskTier(tmp_path / "d", capacity_bytes=300, on_removed=removed.append)
    hashes = [chain_hash(b"", [i]) for i in range(5)]
    for i, h in enumerate(hashes):
        assert disk.spill(h, torch.full((100,), i, dtype=torch.uint8), snapshot=False)
        assert disk.flush()
    assert disk.keys() == hashes[2:] and removed == hashes[:2]
    assert disk.stats.bytes_in_use == 300 and disk.stats.evictions == 2 and len(list(disk.path.iterdir())) == 3
    data, snapshot = disk.take(hashes[3])
    assert data.equal(torch.full((100,), 3, dtype=torch.uint8)) and not snapshot
    assert disk.take(hashes[0]) is None and disk.stats.bytes_in_use == 200
    assert not disk.spill(chain_hash(b"", [9]), torch.zeros(301, dtype=torch.uint8), snapshot=False)  # too big
    disk.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_block_file_is_a_counted_miss(tmp_path, caplog, damage):
    removed = []
    disk = DiskTier(tmp_path / "d", capacity_bytes=1 << 20, on_removed=removed.append)
    h = chain_hash(b"", [1, 2, 3])
    disk.spill(h, torch.arange(200, dtype=torch.uint8), snapshot=True)
    assert disk.flush()
    [file] = disk.path.glob("*.blk")
    raw = bytearray(file.read_bytes())
    if damage == "flip":
        raw[-5] ^= 0xFF
        file.write_bytes(raw)
    elif damage == "truncate":
        file.write_bytes(raw[:-1])
    else:
        file.unlink()
    with caplog.at_level(logging.WARNING):
        assert disk.take(h) is None
    assert disk.stats.read_errors == 1 and removed == [h] and "a miss" in caplog.text
    assert disk.keys() == [] and not list(disk.path.glob("*.blk"))
    disk.close()


def test_a_failing_disk_degrades_to_host_memory_and_the_cache_keeps_serving(tmp_path, caplog, monkeypatch):
    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskTier, "_write", full)  # the injected fault: every write fails
    cache = cache_on_disk(tmp_path, pages=4)
    disk = cache.lower
    a, b, c = prompt(32, seed=1), prompt(64, seed=2), prompt(48, seed=3)
    fill(cache, a, seed=1)
    with caplog.at_level(logging.WARNING):
        fill(cache, b, seed=2)  # `a`'s blocks: spilled, the write fails, dropped
        assert disk.flush()
    assert disk.stats.degraded == 1 and disk.stats.spills == 0 and "serves from host memory only" in caplog.text
    fill(cache, c, seed=3)  # evicts again: refused at once, reported removed as without a tier
    assert disk.stats.dropped >= 4 and disk.keys() == []
    removed = set(cache.events.since(0).removed)
    assert {block_key(h) for h in [chain_hash(b"", a[:16])]} <= removed
    handle = cache.allocate(a + [1])  # a miss, not an error
    assert handle is not None and handle.num_tokens == 0
    disk.close()


def test_the_last_block_of_a_freed_request_is_evicted_before_the_ones_it_needs(tmp_path):
    probe = ModelState(CONFIG, 1, 1, BLOCK, device="meta")
    cache = StateCache(CONFIG, BLOCK, 1, 5 * probe.slot_bytes + 3 * probe.page_bytes, max_snapshots=4)
    tokens = prompt(48, seed=4)
    seq = cache.events.seq
    fill(cache, tokens, seed=4)
    other = cache.allocate()
    assert cache.reserve(other, 16)  # one page: evicts one of the 3 cached blocks
    first = chain_hash(b"", tokens[:16])
    second = chain_hash(first, tokens[16:32])
    third = chain_hash(second, tokens[32:48])
    delta = cache.events.since(seq)
    assert set(delta.removed) == {block_key(third)} and {block_key(first), block_key(second)} <= set(delta.stored)


def test_a_kv_store_serves_a_working_set_larger_than_its_memory_from_disk(tiny_checkpoint, tmp_path):
    """Six conversations' first turns go through P/D and are written to a store that holds about two
    of them in memory; each second turn is looked up and hits its whole history, read back from disk
    where memory evicted it, and every output equals the single engine's."""
    prefill, decode = pair(tiny_checkpoint, LocalAgent)
    probe = ModelState(CONFIG, 1, 1, BLOCK, device="meta")
    memory_mb = (2 * probe.slot_bytes + 10 * probe.page_bytes) / 2**20  # 1 slot, 1 snapshot, ~10 pages
    agent = LocalAgent(f"test-store-{next(_names)}", 8 << 20)
    store = PrefixStore(prefill.model.config, prefill.cache.block_size, agent, memory_mb=memory_mb,
                        inbox_bytes=1 << 20, dtype=prefill.model.dtype, disk_bytes=16 << 20,
                        disk_path=str(tmp_path / "store"), snapshot_share=0.2)
    for engine in (prefill, decode):
        engine.attach_store(store.agent.metadata(), store.add_writer(engine.kv.agent.metadata()))
    greedy = SamplingParams(max_tokens=20, temperature=0.0, seed=3, ignore_eos=True)
    firsts = {f"c{i}": prompt(45, seed=100 + i) for i in range(6)}
    for rid, ids in firsts.items():
        submit(prefill, decode, rid, ids, greedy)
        got, _ = run_with_store(prefill, decode, store)  # one at a time: each turn's put lands in order
        firsts[rid] = ids + got[rid]
    assert store.disk.flush() and store.disk.stats.spills > 0

    seconds = {f"{rid}.2": (history + prompt(11, seed=200 + i), greedy)
               for i, (rid, history) in enumerate(firsts.items())}
    got = {}
    for rid, (ids, params) in seconds.items():
        hit = store.lookup(ids)
        assert hit is not None, rid
        reservation = decode.reserve_push(ids, params, request_id=rid)
        prefill.add_request(ids, params, request_id=rid, push_to=reservation, cached=hit)
        got.update(run_with_store(prefill, decode, store)[0])
    assert_like_single_engine(tiny_checkpoint, seconds, got)
    assert store.stats.hits == len(seconds) and store.stats.disk_hit_tokens > 0 and store.disk.stats.read_errors == 0
    assert prefill.stats()["kv_pulled_tokens"] == store.stats.hit_tokens
    store.close()


def test_a_disk_tier_without_a_size_or_a_place_is_refused_naming_the_setting(tmp_path):
    with pytest.raises(ConfigError, match="store_disk_mb=-1 must be a number of MiB"):
        ServeConfig(store_disk_mb=-1)
    with pytest.raises(ValueError, match="give it a positive size"):
        DiskTier(tmp_path / "d", capacity_bytes=0)
    with pytest.raises(ValueError, match="needs a directory"):
        PrefixStore(CONFIG, BLOCK, LocalAgent(f"test-store-{next(_names)}", 1 << 20), memory_mb=1, inbox_bytes=1 << 16,
                    disk_bytes=1 << 20)


def test_a_dropped_cache_frees_its_memory_at_once_with_or_without_a_tier(tmp_path):
    """No reference cycle holds a cache (and its state tensors) until the garbage collector runs: a
    benchmark that makes caches of gigabytes one after the other relies on it."""
    gc.disable()
    try:
        for tier in (False, True):
            cache = cache_on_disk(tmp_path / str(tier), pages=4) if tier else StateCache(CONFIG, BLOCK, 1, 1 << 20)
            fill(cache, prompt(32, seed=1), seed=1)
            disk, held = cache.lower, weakref.ref(cache)
            del cache
            assert held() is None
            if disk is not None:
                disk.close()
    finally:
        gc.enable()
