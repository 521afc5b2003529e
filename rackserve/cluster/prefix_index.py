"""Which caches hold which blocks: the index a cache-aware router looks prompts up in. Plain Python, no Ray.

The caches of a deployment are numbered once, the same in every process: its DP ranks (decode, then
prefill, in the owner's order) and then its KV stores. Each reports the blocks it stored and evicted
(`BlockDelta`, from its `BlockLog`); `PrefixIndex` keeps, per block key, the set of caches holding it
(a bit mask), so a prompt's keys (`block_events.prefix_keys`) say how many leading blocks each cache
could serve (`match`).

* **Bounded.** At most `max_entries` keys, least recently stored dropped first (a router that forgets
  a block only guesses worse: the caches are the truth). An entry costs about `ENTRY_BYTES` in
  CPython (the ordered dict's slot and node, the int key; masks of a few caches are shared small
  ints), so the default 2^19 entries is ~62 MiB whatever the traffic; counters are per cache, never
  per block or request.
* **Turnover.** Per DP rank, how fast new blocks are stored into its cache: an exponentially decayed
  count of its stored blocks on a clock that ticks once per block stored into any rank, with a time
  constant of a `TURNOVER_SHARE`-th of the blocks all ranks hold (at least `MIN_TURNOVER_BLOCKS`).
  A rank whose cache is full and takes a large share of the new blocks evicts what it holds soonest:
  the router's memory term (`rackserve.cluster.request_router`) steers new prefixes away from it.
* **Alike everywhere.** The owner applies every cache's deltas in the order it gathers them and
  journals them (`BlockJournal`); each router applies the same journal (`IndexReplica`), so every
  router holds the same index — masks, order and turnover — and, given the same loads, routes
  alike. Lookups change nothing.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict, deque

from rackserve.messages import BlockDelta, BlockFeed

ENTRY_BYTES = 124  # measured: tracemalloc over 2^16 and 2^19 entries of random 64-bit keys (tests/test_prefix_index.py)
TURNOVER_SHARE = 2  # the decay's time constant: half the blocks the ranks hold ...
MIN_TURNOVER_BLOCKS = 64  # ... but never fewer than this many blocks stored


class PrefixIndex:
    def __init__(self, caches: int, max_entries: int = 1 << 19, ranks: int | None = None):
        """An index over `caches` caches, the first `ranks` of them DP ranks (default: all), holding at
        most `max_entries` block keys."""
        if max_entries < 1:
            raise ValueError(f"index_entries={max_entries} must be ≥ 1")
        self.caches, self.max_entries = caches, max_entries
        self.ranks = caches if ranks is None else ranks
        self._entries: OrderedDict[int, int] = OrderedDict()  # key -> mask of the caches holding it
        self._held = [0] * caches
        self._turn = [0.0] * self.ranks  # decayed stored blocks, as of `_turn_at`
        self._turn_at = [0] * self.ranks
        self._clock = 0  # blocks stored into any rank so far

    @property
    def size(self) -> int:
        """Block keys held (≤ `max_entries`)."""
        return len(self._entries)

    def held(self, cache: int) -> int:
        """Blocks `cache` holds, as far as the index knows."""
        return self._held[cache]

    def turnover(self, cache: int) -> float:
        """DP rank `cache`'s decayed count of blocks stored (see the module docstring); 0 for a store."""
        if cache >= self.ranks:
            return 0.0
        return self._turn[cache] * math.exp(-(self._clock - self._turn_at[cache]) / self._tau())

    def apply(self, cache: int, delta: BlockDelta) -> None:
        """Take `cache`'s stored and evicted blocks (a reset: forget what it had first)."""
        bit = 1 << cache
        if delta.reset:
            for key in [k for k, m in self._entries.items() if m & bit]:
                self._unset(key, bit)
        for key in delta.removed:
            if self._entries.get(key, 0) & bit:
                self._unset(key, bit)
        for key in delta.stored:
            mask = self._entries.pop(key, 0)
            self._entries[key] = mask | bit  # the newest at the end
            if not mask & bit:
                self._held[cache] += 1
                if cache < self.ranks and not delta.reset:  # a reset lists old blocks, not new ones
                    self._tick(cache)
        while len(self._entries) > self.max_entries:
            _, mask = self._entries.popitem(last=False)
            for c in range(self.caches):
                self._held[c] -= mask >> c & 1

    def match(self, keys: list[int]) -> list[int]:
        """Per cache, how many of `keys` (a prompt's, in order) it holds from the first on."""
        depth, alive = [0] * self.caches, (1 << self.caches) - 1
        for i, key in enumerate(keys):
            alive &= self._entries.get(key, 0)
            if not alive:
                break
            for c in range(self.caches):
                if alive >> c & 1:
                    depth[c] = i + 1
        return depth

    def dump(self) -> tuple:
        """Everything, for `load` in another process: (caches, ranks, max_entries, blocks as (key, mask)
        pairs oldest first, turnover as (value, as of, clock))."""
        return (self.caches, self.ranks, self.max_entries, tuple(self._entries.items()),
                (tuple(self._turn), tuple(self._turn_at), self._clock))

    @classmethod
    def load(cls, dump: tuple) -> PrefixIndex:
        caches, ranks, max_entries, blocks, (turn, turn_at, clock) = dump
        index = cls(caches, max_entries, ranks)
        index._entries = OrderedDict(blocks)
        for mask in index._entries.values():
            for c in range(caches):
                index._held[c] += mask >> c & 1
        index._turn, index._turn_at, index._clock = list(turn), list(turn_at), clock
        return index

    def _unset(self, key: int, bit: int) -> None:
        mask = self._entries[key] & ~bit
        self._held[bit.bit_length() - 1] -= 1
        if mask:
            self._entries[key] = mask
        else:
            del self._entries[key]

    def _tau(self) -> float:
        return max(MIN_TURNOVER_BLOCKS, sum(self._held[:self.ranks]) / TURNOVER_SHARE)

    def _tick(self, rank: int) -> None:
        self._clock += 1
        self._turn[rank] = self.turnover(rank) + 1.0
        self._turn_at[rank] = self._clock


class BlockJournal:
    def __init__(self, caches: int, max_entries: int = 1 << 19, ranks: int | None = None,
                 journal_keys: int = 1 << 20):
        """The owner's index (`PrefixIndex(caches, max_entries, ranks)`) and the deltas it applied, the
        last `journal_keys` keys' worth of them (~50 MiB at the default), for routers to follow."""
        self.index = PrefixIndex(caches, max_entries, ranks)
        self.journal_keys = journal_keys
        self._deltas: deque[tuple[int, int, BlockDelta]] = deque()  # (feed number, cache, delta)
        self._keys = 0
        self.seq = 0  # deltas applied so far
        self._lock = threading.Lock()  # the gathering thread adds, callers' threads read

    def add(self, cache: int, delta: BlockDelta) -> None:
        """Apply and journal `cache`'s delta."""
        if not (delta.stored or delta.removed or delta.reset):
            return
        with self._lock:
            self.index.apply(cache, delta)
            self.seq += 1
            self._deltas.append((self.seq, cache, delta))
            self._keys += len(delta.stored) + len(delta.removed)
            while self._keys > self.journal_keys and len(self._deltas) > 1:
                _, _, old = self._deltas.popleft()
                self._keys -= len(old.stored) + len(old.removed)

    def feed(self, since: int) -> BlockFeed:
        """What a router that applied deltas up to `since` needs: the deltas after it, or (a router
        new, or further behind than the journal reaches) the whole index."""
        with self._lock:
            first = self._deltas[0][0] if self._deltas else self.seq + 1
            if since < 0 or since > self.seq or since + 1 < first:
                return BlockFeed(self.seq, dump=self.index.dump())
            return BlockFeed(self.seq, tuple((c, d) for n, c, d in self._deltas if n > since))


class IndexReplica:
    def __init__(self, caches: int, ranks: int | None = None):
        """A router's copy of the owner's index (`BlockJournal`), empty until its first feed (a dump:
        the owner's `max_entries` comes with it)."""
        self.index = PrefixIndex(caches, ranks=ranks)
        self.seq = -1  # the owner's deltas applied; -1: none yet (the first feed is a dump)

    def apply(self, feed: BlockFeed) -> None:
        if feed.dump is not None:
            self.index = PrefixIndex.load(feed.dump)
        else:
            for cache, delta in feed.deltas:
                self.index.apply(cache, delta)
        self.seq = feed.seq
