"""The state cache: a model's per-request state under a byte budget, with prefix caching.

Memory is one state of the model's family (`rackserve.models.new_state`, a `PagedState`): slots (fixed per
running request; DeepSeek-V4: sliding windows + compressor carry) and pages (one per `block_size`
tokens; V4: compressed entries + indexer keys; a plain KV cache: K and V). This class decides who
owns what:

* `allocate(token_ids)` gives a new request a slot, starting from the longest cached prefix;
  `reserve` adds pages as the request grows; both return None / False to mean "wait", never raise.
* Prefix caching. A full block's page never changes, so it is shared by every request with the
  same token prefix, found by a hash chain over full blocks. To *continue* after a prefix, a request
  also needs its slot's rows at the prefix's end (V4: window and carry): a **snapshot** of a slot,
  taken whenever a request's state sits exactly on a block boundary (the runner arranges that at
  the end of each prefill). A lookup therefore returns the longest chain of cached blocks that ends
  in a block with a snapshot — or, with `exact_rebuild` (a cache whose owner runs the model), ends
  at the chain's last block when that saves more: the request recomputes the last
  `PagedState.rebuild_tokens` tokens before it over the cached pages (their entries kept, its windows
  and carry rebuilt), which is exact (the slot's receptive field is that long). With bounded replay
  (DeepSeek-V4.1, `PagedState.replay_window` W) every cached block is a usable hit: without a snapshot
  at the hit's end h, the request recomputes its last min(W, h) tokens to rebuild the windows (their
  entries stay as cached, the Engram lookback is written from the token ids), an approximation of the
  exact state that DeepSeek serves with.
  `rebuild` does the same for blocks read from a KV store (`StoreHit.resume_at`).
* Pages are reference-counted (holding requests + 1 for the cache); a cached block nobody holds is
  evictable, least recently used first, when a request needs memory. Snapshots have an LRU of their
  own (taken or resumed at): a freed request's last block is the first of its pages to go, but its
  snapshot, the end of a conversation's newest turn, is what the next turn resumes at.
* Every block stored and evicted is logged (`events`, a `BlockLog`), for routers that route by
  what each cache holds (`rackserve.cluster.prefix_index`).
* A lower tier (`attach_lower`, e.g. a KV store's `DiskTier`) takes the blocks evicted (a block there still
  counts as held in `events`) and gives them back when a lookup's chain reaches one.
* `fork(handle)` gives a new request a copy of a running one's state, copy-on-write: the slot is
  copied, the full pages shared, only a partly filled last page copied (the choices of one prompt,
  `SamplingParams.n`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rackserve.engine.block_events import BlockLog, chain_hash
from rackserve.models import new_state
from rackserve.models.interface import ModelSpec
from rackserve.models.state import RequestState, StateBlob


@dataclass
class CacheHandle(RequestState):
    """A request's state handle plus the hash chain of its full blocks, and the block of the snapshot
    it took where a prompt chunk ended with more of its prompt to come (`passing_snapshot`)."""

    block_hashes: list[bytes] = field(default_factory=list)
    passing_snapshot: bytes | None = None


class LowerTier(Protocol):
    """Where a cache's evicted blocks go, and come back from (`rackserve.engine.disk_tier.DiskTier`)."""

    def spill(self, block_hash: bytes, data: torch.Tensor, snapshot: bool) -> bool:
        """Keep an evicted block (`PagedState.block_bytes`); False if it is dropped instead."""

    def take(self, block_hash: bytes) -> tuple[torch.Tensor, bool] | None:
        """A kept block's (bytes, snapshot), out of the tier; None if it holds none."""

    def discard(self, hashes: list[bytes]) -> None:
        """Forget blocks the cache stores again."""

    def keys(self) -> list[bytes]:
        """The blocks kept."""


@dataclass
class _Block:
    page: int
    snapshot: int | None = None  # slot holding the window/carry at this block's end


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0  # lookups that reused at least one block
    hit_tokens: int = 0  # prompt tokens whose prefill was skipped
    replayed_tokens: int = 0  # cached tokens recomputed to rebuild windows (bounded replay)
    evictions: int = 0
    snapshots: int = 0
    promoted: int = 0  # blocks a lookup took back from the lower tier


class StateCache:
    def __init__(self, config: ModelSpec, block_size: int, max_requests: int, budget_bytes: int,
                 prefix_caching: bool = True, max_snapshots: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", draft_layers: int = 0,
                 state_dtype: str = "auto", bounded_replay: bool = False, exact_rebuild: bool = False):
        """Size the memory from `budget_bytes`: `max_requests + max_snapshots` slots, pages for the rest.
        `draft_layers`: 1 to hold the draft model's state too (speculative decoding); `state_dtype`: how
        the family stores what it may quantise (`EngineConfig.state_dtype`); `bounded_replay` as
        `EngineConfig.bounded_replay`; `exact_rebuild`: hits may end at a block without a snapshot, whose
        slot the request rebuilds (the owner runs the model; a KV store does not)."""
        max_snapshots = (max_requests if max_snapshots is None else max_snapshots) if prefix_caching else 0
        probe = new_state(config, 1, 1, block_size, dtype, "meta", draft_layers, state_dtype, bounded_replay)
        slots = max_requests + max_snapshots
        slot_bytes, page_bytes = probe.slot_bytes, probe.page_bytes
        rest = budget_bytes - slots * slot_bytes
        pages = rest // page_bytes if probe.uses_pages else 0
        if rest < 0 or (probe.uses_pages and pages < 1):
            raise ValueError(
                f"a state budget of {budget_bytes / 2**20:.1f} MiB cannot hold {slots} slots of "
                f"{slot_bytes / 2**20:.2f} MiB plus pages of {page_bytes / 2**20:.3f} MiB; raise the state "
                "memory or lower max_num_seqs / prefix_snapshots"
            )
        self.state = new_state(config, slots, int(pages), block_size, dtype, device, draft_layers, state_dtype,
                               bounded_replay)
        self.block_size, self.max_snapshots, self.prefix_caching = block_size, max_snapshots, prefix_caching
        # tokens a hit without a snapshot recomputes before its end: bounded replay's (approximate) or an
        # exact rebuild's; 0: such a hit is not possible
        self._replay_tokens = self.state.replay_window or (self.state.rebuild_tokens if exact_rebuild else 0)
        self.stats = CacheStats()
        self._free_slots = list(range(slots - 1, -1, -1))
        self._free_pages = list(range(int(pages) - 1, -1, -1))
        self._page_refs = [0] * int(pages)
        self._blocks: dict[bytes, _Block] = {}
        self._evictable: OrderedDict[bytes, None] = OrderedDict()  # refs == 1 (cache only), oldest first
        # blocks with a snapshot, least recently used (taken or resumed at) first: a conversation's
        # newest turn end is what its next turn resumes at, so it goes after every older snapshot
        self._snapshots: OrderedDict[bytes, None] = OrderedDict()
        self.lower: LowerTier | None = None  # `attach_lower`
        # the log holds the dict's method, not this cache's: no cycle keeps the state's memory alive
        self.events = BlockLog(self._blocks.keys)
        # called before this cache, or a caller outside the forward (`KVPort`), reads or writes a
        # slot's state: with async scheduling, waits for the step in flight, which may still write it
        self.fence: Callable[[], None] = lambda: None

    def attach_lower(self, tier: LowerTier) -> None:
        """Put `tier` under this cache: it takes the blocks evicted, and what it holds counts as held in `events`."""
        self.lower = tier
        self.events.add_held(tier.keys)

    # ---- sizes -----------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.state.num_pages

    @property
    def bytes_total(self) -> int:
        return self.state.num_slots * self.state.slot_bytes + self.num_pages * self.state.page_bytes

    @property
    def bytes_in_use(self) -> int:
        used_slots = self.state.num_slots - len(self._free_slots)
        used_pages = self.num_pages - len(self._free_pages)
        return used_slots * self.state.slot_bytes + used_pages * self.state.page_bytes

    @property
    def bytes_cached(self) -> int:
        """Of `bytes_in_use`, what only the prefix cache holds (snapshots, and blocks no request
        holds): given back as soon as requests need it."""
        return len(self._evictable) * self.state.page_bytes + len(self._snapshots) * self.state.slot_bytes

    def pages_for(self, num_tokens: int) -> int:
        return self.state.pages_for(num_tokens)

    # ---- allocation --------------------------------------------------------------------------------
    def allocate(self, token_ids: list[int] | None = None) -> CacheHandle | None:
        """A slot for a new request, primed with the longest cached prefix of `token_ids`.

        At least the last token is always left to compute (its logits are needed). None if no slot
        can be had. The handle's `num_tokens` says how many tokens the prefix cache covered (under
        bounded replay, up to the window's worth fewer than the hit: those are recomputed).
        """
        slot = self._take_slot()
        if slot is None:
            return None
        handle = CacheHandle(slot=slot)
        if self.prefix_caching and token_ids:
            self.stats.lookups += 1
            if self.lower is not None:
                self._promote(token_ids[:-1])
            chain, best = self._lookup(token_ids[:-1])
            use = self._usable(chain, best)
            if use >= 0:
                for h in chain[: use + 1]:
                    block = self._blocks[h]
                    self._ref_page(block.page)
                    handle.pages.append(block.page)
                    self._evictable.pop(h, None)
                handle.block_hashes = chain[: use + 1]
                hit = (use + 1) * self.block_size
                snapshot = self._blocks[chain[use]].snapshot
                self.fence()
                if snapshot is not None:
                    self.state.copy_slot(snapshot, slot)
                    self._snapshots.move_to_end(chain[use])
                    handle.num_tokens = hit
                else:  # bounded replay or an exact rebuild: the windows from the hit's last tokens
                    self._replay_before(handle, token_ids, hit)
                self.stats.hits += 1
                self.stats.hit_tokens += handle.num_tokens
        return handle

    def fork(self, handle: CacheHandle) -> CacheHandle | None:
        """A new request holding a copy of `handle`'s state at its `num_tokens`: the slot copied, the
        full pages shared (a full block never changes again), a partly filled last page copied (both
        write there next). None (nothing taken) when no slot, or no page for that copy, can be had."""
        slot = self._take_slot()
        if slot is None:
            return None
        n = handle.num_tokens
        used = self.pages_for(n)
        # full blocks: the cached ones a replayed prefix still recomputes besides (`entries_until`)
        full = max(min(used, n // self.block_size), handle.entries_until // self.block_size)
        child = CacheHandle(slot=slot, num_tokens=n, block_hashes=list(handle.block_hashes),
                            window_from=handle.window_from, entries_until=handle.entries_until)
        if used > full and not self.reserve(child, 1):  # one page, for the copy of the partial block
            self._free_slots.append(slot)
            return None
        copy = child.pages  # the page reserve took for the partial block, if any
        self.fence()
        self.state.copy_slot(handle.slot, slot)
        if copy:
            self.state.copy_page(handle.pages[full], copy[0])
        for page in handle.pages[:full]:
            self._ref_page(page)
        child.pages = handle.pages[:full] + copy
        return child

    def reserve(self, handle: CacheHandle, num_tokens: int) -> bool:
        """Give `handle` the pages for `num_tokens` tokens, evicting cached blocks if needed.
        False (and nothing taken) when even eviction cannot free enough: the caller waits or preempts."""
        need = self.pages_for(num_tokens) - len(handle.pages)
        if need <= 0:
            return True
        while len(self._free_pages) < need and self._evict_one():
            pass
        if len(self._free_pages) < need:
            return False
        for _ in range(need):
            page = self._free_pages.pop()
            self._page_refs[page] = 1
            handle.pages.append(page)
        return True

    def free(self, handle: CacheHandle) -> None:
        """Release `handle`'s slot and pages; cached blocks stay (evictable) for later requests."""
        for page in handle.pages:
            self._unref_page(page)
        # the last block first: it is the older then, evicted before the blocks it needs to be of use
        for h in reversed(handle.block_hashes):
            block = self._blocks.get(h)
            if block is not None and self._page_refs[block.page] == 1:
                self._evictable[h] = None
                self._evictable.move_to_end(h)
        self._free_slots.append(handle.slot)
        handle.pages, handle.block_hashes, handle.num_tokens = [], [], 0

    # ---- prefix cache ------------------------------------------------------------------------------
    def advance(self, handle: CacheHandle, num_tokens: int, token_ids: list[int],
                copies: list[tuple[int, int]] | None = None, passing: bool = False) -> None:
        """`handle` ran (or will have run) `num_tokens` more tokens (its tokens so far: `token_ids`):
        count them and `commit`."""
        handle.num_tokens += num_tokens
        self.commit(handle, token_ids, copies, passing)

    def commit(self, handle: CacheHandle, token_ids: list[int], copies: list[tuple[int, int]] | None = None,
               passing: bool = False) -> None:
        """Register `handle`'s newly completed full blocks (`token_ids` = its tokens so far, at least
        up to its last full block), and snapshot its slot if it sits exactly on a block boundary.
        `copies`: when given, the snapshot is a (slot, snapshot slot) copy appended there, for the
        caller to run once the state has reached the boundary (the forward that gets it there may
        not have run yet). `passing`: a prompt chunk that ends here with more of the prompt to come: its
        snapshot is given up when the request takes its next (a hit rarely ends mid-prompt where a chunk
        happened to end, and with a rebuild it need not), so chunked prefills of long prompts do not
        crowd out the snapshots where prompts end, which the next turns resume at."""
        if not self.prefix_caching:
            return
        b = self.block_size
        full = self._register(handle, token_ids)
        # a replayed prefix (bounded replay) passes boundaries whose blocks are cached already
        if full and handle.num_tokens == full * b and full == len(handle.block_hashes):
            block = self._blocks[handle.block_hashes[-1]]
            passed = self._blocks.get(handle.passing_snapshot) if handle.passing_snapshot else None
            if block.snapshot is None and passed is not None and passed.snapshot is not None:
                self._drop_snapshot(handle.passing_snapshot)  # taken by an earlier step: its copy ran
                self.stats.evictions += 1
            handle.passing_snapshot = None
            if block.snapshot is None and len(self._snapshots) >= self.max_snapshots:
                self._evict_snapshot()  # the newest boundary is the likeliest to be resumed
                if len(self._snapshots) >= self.max_snapshots:
                    self._drop_superseded(handle)
            if block.snapshot is None and len(self._snapshots) < self.max_snapshots and self._free_slots:
                block.snapshot = self._free_slots.pop()
                self._snapshots[handle.block_hashes[-1]] = None
                handle.passing_snapshot = handle.block_hashes[-1] if passing else None
                if copies is None:
                    self.state.copy_slot(handle.slot, block.snapshot)
                else:
                    copies.append((handle.slot, block.snapshot))
                self.stats.snapshots += 1

    def rebuild(self, handle: CacheHandle, token_ids: list[int]) -> None:
        """`handle` holds the pages of its first `num_tokens` tokens (whole blocks), read from a KV
        store's blocks that end without a snapshot, and a slot of no use: register the blocks and set
        it to replay the last `replay_tokens` of them over those pages, rebuilding the slot, as
        `allocate` does on such a hit of this cache's own (`token_ids`: at least its tokens)."""
        if self.prefix_caching:
            self._register(handle, token_ids)
        self._replay_before(handle, token_ids, handle.num_tokens)

    def _replay_before(self, handle: CacheHandle, token_ids: list[int], hit: int) -> None:
        """Set `handle`, holding the pages of a hit of `hit` tokens without a snapshot, to recompute
        its last `replay_tokens` over those pages (their entries kept) to rebuild its slot."""
        start = hit - min(self._replay_tokens, hit)
        self.state.prime(handle.slot, token_ids, start)
        handle.num_tokens = handle.window_from = start
        handle.entries_until = hit
        self.stats.replayed_tokens += hit - start

    @property
    def replay_tokens(self) -> int:
        """Tokens a hit on a block without a snapshot replays before it (bounded replay's window, or an
        exact rebuild's); 0: a hit needs a snapshot."""
        return self._replay_tokens

    def prefix_state(self, handle: CacheHandle) -> RequestState | None:
        """The state at the end of `handle`'s longest cached prefix that has a snapshot: the snapshot's
        slot with the prefix's pages (for exporting the prefix, e.g. to a KV store); None if none."""
        for i in range(len(handle.block_hashes) - 1, -1, -1):
            block = self._blocks.get(handle.block_hashes[i])
            if block is not None and block.snapshot is not None:
                return RequestState(block.snapshot, handle.pages[: i + 1], (i + 1) * self.block_size)
        return None

    def cached_tokens(self, token_ids: list[int]) -> int:
        """The prompt tokens of `token_ids` that `allocate` would skip now (its last token is always
        computed; tokens replayed to rebuild a slot are not skipped); nothing is taken or touched."""
        if not self.prefix_caching or not token_ids:
            return 0
        chain, best = self._lookup(token_ids[:-1])
        use = self._usable(chain, best)
        hit = (use + 1) * self.block_size
        if use < 0 or self._blocks[chain[use]].snapshot is not None:
            return hit
        return hit - min(self._replay_tokens, hit)

    def _register(self, handle: CacheHandle, token_ids: list[int]) -> int:
        """Add `handle`'s newly completed full blocks to the index (their pages held by it too); the
        number of full blocks it has."""
        b = self.block_size
        full, done = handle.num_tokens // b, len(handle.block_hashes)
        new = token_ids[done * b:full * b]  # one slice (a simulated request computes its tokens on each)
        for i in range(done, full):
            parent = handle.block_hashes[-1] if handle.block_hashes else b""
            h = chain_hash(parent, new[(i - done) * b:(i - done + 1) * b])
            handle.block_hashes.append(h)
            if h not in self._blocks:
                self._blocks[h] = _Block(page=handle.pages[i])
                self._ref_page(handle.pages[i])
                self.events.stored(h)
                if self.lower is not None:
                    self.lower.discard([h])
        return full

    def _usable(self, chain: list[bytes], best: int) -> int:
        """Of a `_lookup`'s chain, the index of the last block a request can start after (-1: none):
        any cached block under bounded replay; else the last with a snapshot, or with an exact rebuild
        the chain's last when rebuilding there recomputes fewer tokens than resuming at that snapshot."""
        if self.state.replay_window:
            return len(chain) - 1
        if self._replay_tokens and len(chain) * self.block_size - self._replay_tokens > (best + 1) * self.block_size:
            return len(chain) - 1
        return best

    def _lookup(self, token_ids: list[int]) -> tuple[list[bytes], int]:
        """Hashes of the cached full blocks of `token_ids`, and the index of the last one with a snapshot."""
        b, chain, best, parent = self.block_size, [], -1, b""
        for i in range(len(token_ids) // b):
            parent = chain_hash(parent, token_ids[i * b:(i + 1) * b])
            block = self._blocks.get(parent)
            if block is None:
                break
            chain.append(parent)
            if block.snapshot is not None:
                best = i
        return chain, best

    def _promote(self, token_ids: list[int]) -> None:
        """Bring back from the lower tier the blocks of `token_ids` this cache lacks, up to the first
        block neither holds; the blocks on the way become the most recently used, so that the room
        made for the next is not taken from them."""
        b, parent, chain = self.block_size, b"", set()
        for i in range(len(token_ids) // b):
            parent = chain_hash(parent, token_ids[i * b:(i + 1) * b])
            chain.add(parent)
            if parent in self._blocks:
                if parent in self._evictable:
                    self._evictable.move_to_end(parent)
                continue
            if not self._free_pages and not self._evict_one():
                return
            got = self.lower.take(parent)
            if got is None:
                return
            data, snapshot = got
            if snapshot and len(self._snapshots) >= self.max_snapshots:
                self._evict_snapshot(frozenset(chain))
            slot = self._free_slots.pop() if snapshot and len(self._snapshots) < self.max_snapshots \
                and self._free_slots else None
            page = self._free_pages.pop()
            self._page_refs[page] = 1
            self.fence()
            self.state.write_block(data, page, slot)
            self._blocks[parent] = _Block(page=page, snapshot=slot)
            self._evictable[parent] = None
            if slot is not None:
                self._snapshots[parent] = None
            self.events.stored(parent)
            self.stats.promoted += 1

    # ---- internals ---------------------------------------------------------------------------------
    def _take_slot(self) -> int | None:
        if not self._free_slots:
            self._evict_snapshot()
        return self._free_slots.pop() if self._free_slots else None

    def _evict_snapshot(self, chain: frozenset[bytes] = frozenset()) -> None:
        """Free the slot of the least recently used snapshot on a block nobody holds (requests come
        before snapshots). With a lower tier its block goes down with it: a hit there needs both. The
        blocks of `chain` (a lookup's, being read back) keep theirs unless no other is left; then one
        loses only its snapshot (a later block's is what the lookup needs)."""
        fallback = None
        for h in self._snapshots:
            if h not in self._evictable:
                continue
            if h in chain:
                fallback = fallback or h
            elif self.lower is not None:
                del self._evictable[h]
                self._evict(h)
                return
            else:
                fallback = h
                break
        if fallback is not None:
            self._drop_snapshot(fallback)
            self.stats.evictions += 1

    def _drop_superseded(self, handle: CacheHandle) -> None:
        """Every snapshot is on blocks that requests hold (a conversation's turns, each resumed at the
        last one's end, pile them up along its chain): free the one nearest before `handle`'s new end in
        its own chain, which its continuation, snapshotted now, supersedes. (A copy into that slot still
        pending from this step is followed by the new snapshot's, into the same slot.)"""
        for h in reversed(handle.block_hashes[:-1]):
            block = self._blocks.get(h)
            if block is not None and block.snapshot is not None:
                self._drop_snapshot(h)
                self.stats.evictions += 1
                return

    def _evict_one(self) -> bool:
        """Drop the least recently used block nobody holds; False if there is none."""
        if not self._evictable:
            return False
        h, _ = self._evictable.popitem(last=False)
        self._evict(h)
        return True

    def _evict(self, h: bytes) -> None:
        """Drop cached block `h` (out of `_evictable` already): to the lower tier if there is one."""
        block = self._blocks.pop(h)
        kept = False
        if self.lower is not None:
            self.fence()
            kept = self.lower.spill(h, self.state.block_bytes(block.page, block.snapshot), block.snapshot is not None)
        if not kept:
            self.events.removed(h)
        if block.snapshot is not None:
            self._free_slots.append(block.snapshot)
            del self._snapshots[h]
        self._unref_page(block.page)
        self.stats.evictions += 1

    def _drop_snapshot(self, h: bytes) -> None:
        """Free the slot of cached block `h`'s snapshot; the block stays."""
        block = self._blocks[h]
        self._free_slots.append(block.snapshot)
        block.snapshot = None
        del self._snapshots[h]

    def _ref_page(self, page: int) -> None:
        self._page_refs[page] += 1

    def _unref_page(self, page: int) -> None:
        self._page_refs[page] -= 1
        if self._page_refs[page] == 0:
            self._free_pages.append(page)

    # ---- transfer ----------------------------------------------------------------------------------
    def export(self, handle: CacheHandle) -> StateBlob:
        return self.state.export(handle)

    def import_(self, blob: StateBlob) -> CacheHandle | None:
        """A new request holding `blob`'s state; None when slots or pages are short (wait)."""
        handle = self.allocate()
        if handle is None:
            return None
        if not self.reserve(handle, blob.num_tokens):
            self.free(handle)
            return None
        self.state.write(handle, blob)
        return handle
