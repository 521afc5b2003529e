"""A host-memory prefix cache shared by many ranks, reached over NIXL (the core of a KV-store actor).

It is a `StateCache` (hash chains of full blocks, boundary snapshots, LRU eviction, a byte
budget) in host memory behind a `KVAgent`:

* PUT: every writer rank gets an *inbox*, a range of the store's pool it sub-allocates itself. It
  WRITEs a prefix's state (a block boundary's snapshot + the prefix's pages, `PagedState.export_into`
  layout) into its inbox with the notification ["put", offset, nbytes, token ids]; `poll` imports it,
  registers its blocks and snapshot, and answers ["freed", offset] so the writer can reuse the range.
* GET: `lookup(token_ids)` exports the longest cached prefix (ending in a snapshot) into a pinned
  range and returns where it is; the reader READs it and sends ["release", address]. Pins expire
  after `pin_ttl_s` in case a reader dies.

A missing or dead store only costs recomputation: readers and writers treat it as a cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgpack
import torch

from rackserve.engine.state_cache import StateCache
from rackserve.models.interface import ModelSpec
from rackserve.transfer.kv import KVAgent, RemoteRegion


@dataclass
class StoreStats:
    puts: int = 0  # prefixes written in
    put_tokens: int = 0
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    pinned: int = 0  # lookup results waiting to be read now


class PrefixStore:
    def __init__(self, config: ModelSpec, block_size: int, agent: KVAgent, memory_mb: float,
                 inbox_bytes: int, snapshot_share: float = 0.25, pin_ttl_s: float = 30.0, draft_layers: int = 0,
                 dtype: torch.dtype = torch.float32, state_dtype: str = "auto"):
        """`memory_mb` of cached state (blocks and snapshots; `snapshot_share` of it at most for
        snapshots); the agent's pool holds the inboxes (`inbox_bytes` per writer) and pinned reads;
        `draft_layers`: 1 when the writers' state has the draft model's (speculative decoding); `dtype` and
        `state_dtype`: the writers' (the store holds their bytes as they are)."""
        budget = int(memory_mb * 2**20)
        layout = dict(dtype=dtype, draft_layers=draft_layers, state_dtype=state_dtype)
        probe = StateCache(config, block_size, 1, budget, prefix_caching=True, max_snapshots=0, device="meta", **layout)
        snapshots = max(1, int(budget * snapshot_share) // probe.state.slot_bytes)
        self.cache = StateCache(config, block_size, 1, budget, prefix_caching=True, max_snapshots=snapshots, **layout)
        self.agent, self.inbox_bytes, self.pin_ttl_s = agent, inbox_bytes, pin_ttl_s
        self._inboxes: dict[str, int] = {}  # writer agent name -> offset of its inbox in the pool
        self._pins: dict[int, float] = {}  # pool offset of a lookup result -> expiry (time.monotonic())
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

    def lookup(self, token_ids: list[int]) -> tuple[int, RemoteRegion] | None:
        """The longest cached prefix of `token_ids` (at least one token is left to compute): its
        length in tokens and where to READ its state; None on a miss or when memory is short."""
        self.stats.lookups += 1
        handle = self.cache.allocate(token_ids)
        if handle is None:
            return None
        try:
            n = handle.num_tokens
            offset = self.agent.alloc(self.cache.state.blob_nbytes(n)) if n else None
            if offset is None:
                return None
            self.cache.state.export_into(handle, self.agent.view(offset, self.cache.state.blob_nbytes(n)))
        finally:
            self.cache.free(handle)
        self._pins[offset] = time.monotonic() + self.pin_ttl_s
        self.stats.hits += 1
        self.stats.hit_tokens += n
        return n, self.agent.region(offset, self.cache.state.blob_nbytes(n))

    def poll(self) -> None:
        """Take in PUTs and releases; drop expired pins."""
        for peer, message in self.agent.notifications():
            kind, *fields = msgpack.unpackb(message)
            if kind == "put" and peer in self._inboxes:
                offset, nbytes, token_ids = fields
                self._put(self._inboxes[peer] + offset, nbytes, token_ids)
                self.agent.notify(peer, msgpack.packb(["freed", offset]))
            elif kind == "release":
                self._unpin(fields[0] - self.agent.pool.data_ptr())
        now = time.monotonic()
        for offset in [o for o, expiry in self._pins.items() if expiry < now]:
            self._unpin(offset)
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

    def _unpin(self, offset: int) -> None:
        if self._pins.pop(offset, None) is not None:
            self.agent.free(offset)
