"""A host-memory prefix cache shared by many ranks, reached over NIXL (the core of a KV-store actor).

It is a `StateCache` (hash chains of full blocks, boundary snapshots, LRU eviction, a byte
budget) in host memory behind a `KVTransport` (a `KVAgent` in the actor):

* PUT: every writer rank gets an *inbox*, a range of the store's pool it sub-allocates itself. It
  WRITEs a prefix's state (a block boundary's snapshot + the prefix's pages, `PagedState.export_into`
  layout) into its inbox with the notification `Put`; `poll` imports it, registers its blocks and
  snapshot, and answers `Freed` so the writer can reuse the range.
* GET: `lookup(token_ids)` exports the longest cached prefix into a pinned range and returns where
  it is (`StoreHit`); the reader READs it and sends `Release`. Pins expire after `pin_ttl_s` in case
  a reader dies. A prefix may end at any cached block: where it has no snapshot, the reader replays
  its last tokens over the blocks read to rebuild the slot (`StateCache.rebuild`), as a rank does on
  such a hit in its own cache; a closer snapshot still wins when resuming there computes less.
* With `disk_bytes`, blocks evicted from host memory go to a local-disk tier (`DiskTier`, under
  `disk_path`) and a lookup reaching one reads it back into host memory first.

The notifications are `rackserve.transfer.messages`; malformed or unexpected ones are logged and dropped.

A missing or dead store only costs recomputation: readers and writers treat it as a cache.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from rackserve.engine.disk_tier import DiskTier
from rackserve.engine.state_cache import StateCache
from rackserve.models.interface import ModelSpec
from rackserve.transfer.messages import Freed, Put, Release, receive, send
from rackserve.transfer.transport import KVTransport, RemoteRegion, StoreHit

log = logging.getLogger(__name__)


@dataclass
class StoreStats:
    puts: int = 0  # prefixes written in
    put_tokens: int = 0
    lookups: int = 0
    lookup_tokens: int = 0  # prompt tokens asked for
    hits: int = 0
    hit_tokens: int = 0
    disk_hit_tokens: int = 0  # of `hit_tokens`, in blocks read back from the disk tier for the lookup
    pinned: int = 0  # lookup results waiting to be read now


def store_cache(config: ModelSpec, block_size: int, budget_bytes: int, snapshot_share: float = 0.25,
                device: str = "cpu", **layout) -> StateCache:
    """A KV store's cache: blocks and snapshots in `budget_bytes`, `snapshot_share` of it at most for
    snapshots; `layout`: the writers' `dtype`, `draft_layers`, `state_dtype`, `bounded_replay`
    (`StateCache`'s). Its hits may end without a snapshot where its readers, which run the model,
    can rebuild the slot (`exact_rebuild`)."""
    probe = StateCache(config, block_size, 1, budget_bytes, prefix_caching=True, max_snapshots=0, device="meta",
                       **layout)
    # a state without slot tensors (a plain KV cache) snapshots for free: at most one per cached block
    slot_bytes = probe.state.slot_bytes
    snapshots = max(1, int(budget_bytes * snapshot_share) // slot_bytes if slot_bytes else probe.num_pages)
    return StateCache(config, block_size, 1, budget_bytes, prefix_caching=True, max_snapshots=snapshots,
                      device=device, exact_rebuild=True, **layout)


class PrefixStore:
    def __init__(self, config: ModelSpec, block_size: int, agent: KVTransport, memory_mb: float,
                 inbox_bytes: int, snapshot_share: float = 0.25, pin_ttl_s: float = 30.0, draft_layers: int = 0,
                 dtype: torch.dtype = torch.float32, state_dtype: str = "auto", bounded_replay: bool = False,
                 disk_bytes: int = 0, disk_path: str | None = None):
        """`memory_mb` of cached state (blocks and snapshots; `snapshot_share` of it at most for
        snapshots); the agent's pool holds the inboxes (`inbox_bytes` per writer) and pinned reads;
        `draft_layers`: 1 when the writers' state has the draft model's (speculative decoding); `dtype`,
        `state_dtype` and `bounded_replay`: the writers' (the store holds their bytes as they are, and its
        hits without a snapshot replay what theirs do); `disk_bytes` of a disk
        tier in the directory `disk_path` (this store's alone: it is emptied), none at 0."""
        self.cache = store_cache(config, block_size, int(memory_mb * 2**20), snapshot_share, dtype=dtype,
                                 draft_layers=draft_layers, state_dtype=state_dtype, bounded_replay=bounded_replay)
        self.disk = None
        if disk_bytes:
            if not disk_path:
                raise ValueError("a KV store's disk tier needs a directory (disk_path)")
            self.disk = DiskTier(disk_path, disk_bytes, on_removed=self.cache.events.removed)
            self.cache.attach_lower(self.disk)
        self.agent, self.inbox_bytes, self.pin_ttl_s = agent, inbox_bytes, pin_ttl_s
        self._inboxes: dict[str, int] = {}  # writer agent name -> offset of its inbox in the pool
        # a lookup result's region address (what its reader's Release names) -> (pool offset, expiry: time.monotonic())
        self._pins: dict[int, tuple[int, float]] = {}
        self.stats = StoreStats()

    def add_writer(self, metadata: bytes) -> RemoteRegion:
        """Learn a writer (or reader) rank from its agent metadata; returns its inbox."""
        name = self.agent.add_peer(metadata)
        if name not in self._inboxes:
            offset = self.agent.alloc(self.inbox_bytes)
            if offset is None:
                raise MemoryError(f"the KV store's pool has no room for another {self.inbox_bytes}-byte inbox; "
                                  "raise its pool size")
            self._inboxes[name] = offset
        return self.agent.region(self._inboxes[name], self.inbox_bytes)

    def remove_writer(self, name: str) -> None:
        """Forget the writer agent `name` (its rank is gone): its inbox returns to the pool, its
        connection is dropped. Unknown names are ignored."""
        offset = self._inboxes.pop(name, None)
        if offset is not None:
            self.agent.free(offset)
        self.agent.remove_peer(name)

    def lookup(self, token_ids: list[int]) -> StoreHit | None:
        """The longest cached prefix of `token_ids` (at least one token is left to compute): its
        length in tokens, where to READ its state, and where the reader resumes; None on a miss or
        when memory is short."""
        self.stats.lookups += 1
        self.stats.lookup_tokens += len(token_ids)
        promoted = self.cache.stats.promoted
        handle = self.cache.allocate(token_ids)
        if handle is None:
            return None
        promoted = self.cache.stats.promoted - promoted
        try:
            # a hit without a snapshot: the blocks up to its end (`entries_until`) go, the reader rebuilds
            resume_at = handle.num_tokens
            n = handle.num_tokens = max(handle.num_tokens, handle.entries_until)
            offset = self.agent.alloc(self.cache.state.blob_nbytes(n)) if n else None
            if offset is None:
                return None
            self.cache.state.export_into(handle, self.agent.view(offset, self.cache.state.blob_nbytes(n)))
        finally:
            self.cache.free(handle)
        region = self.agent.region(offset, self.cache.state.blob_nbytes(n))
        self._pins[region.addr] = (offset, time.monotonic() + self.pin_ttl_s)
        self.stats.hits += 1
        self.stats.hit_tokens += n
        self.stats.disk_hit_tokens += min(n, promoted * self.cache.block_size)
        return StoreHit(n, region, resume_at)

    def poll(self) -> None:
        """Take in PUTs and releases; drop expired pins."""
        for peer, message in receive(self.agent.notifications()):
            match message:
                case Put(offset, nbytes, token_ids) if peer in self._inboxes:
                    if not 0 <= offset <= self.inbox_bytes - nbytes:
                        log.warning("ignored %s from %r: it is not inside its %d-byte inbox", message, peer,
                                    self.inbox_bytes)
                        continue
                    self._put(self._inboxes[peer] + offset, nbytes, token_ids)
                    send(self.agent, peer, Freed(offset))
                case Release(addr):
                    self._unpin(addr)
                case _:
                    log.warning("ignored %s from %r: the KV store expects no such notification from it", message, peer)
        now = time.monotonic()
        for addr in [a for a, (_, expiry) in self._pins.items() if expiry < now]:
            self._unpin(addr)
        self.stats.pinned = len(self._pins)

    def _put(self, offset: int, nbytes: int, token_ids: list[int]) -> None:
        n = len(token_ids)
        if n % self.cache.block_size or self.cache.state.blob_nbytes(n) != nbytes:
            return  # not a prefix of whole blocks in this layout: a misconfigured writer, ignore it
        handle = self.cache.allocate()
        if handle is None:
            return
        if self.cache.reserve(handle, n):
            self.cache.state.import_from(handle, self.agent.view(offset, nbytes), n)
            self.cache.commit(handle, token_ids)
            self.stats.puts += 1
            self.stats.put_tokens += n
        self.cache.free(handle)

    def close(self) -> None:
        """Stop the disk tier's writer and remove its files."""
        if self.disk is not None:
            self.disk.close()

    def _unpin(self, addr: int) -> None:
        pin = self._pins.pop(addr, None)
        if pin is not None:
            self.agent.free(pin[0])
