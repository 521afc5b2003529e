"""Block hashes, and the log of blocks a cache stored and evicted, for routers that route by cache.

A full block of `block_size` tokens is named by a chain hash over every token up to its end
(`chain_hash`), the same in every process, so a router can say which caches hold a prompt's prefix
without asking them: it hashes the prompt (`prefix_keys`) and looks the keys up in an index built
from the caches' events (`rackserve.cluster.prefix_index`). A key is the hash's first 8 bytes as an
int (`block_key`): 2^-64 of colliding is far below what a routing guess needs, and an int is what
the index stores cheaply.

`BlockLog` is one cache's side: every block it stores or evicts, numbered, read in deltas since
what the reader saw (`since`). It holds at most `max_events`; a reader that fell further behind (or
a new one) gets the whole list of blocks held instead (`BlockDelta.reset`). The cache's thread logs,
another reads (an actor's load call), hence the lock.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterable

import numpy as np

from rackserve.messages import BlockDelta


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The hash of a block: its tokens chained to the hash of everything before it (16 bytes)."""
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


def block_key(block_hash: bytes) -> int:
    """The key routers know a block by: its hash's first 8 bytes, as an unsigned int."""
    return int.from_bytes(block_hash[:8], "big")


def prefix_keys(token_ids: list[int], block_size: int) -> list[int]:
    """The keys of `token_ids`' full blocks, in order (a prompt's last partial block has none)."""
    keys, parent = [], b""
    for i in range(len(token_ids) // block_size):
        parent = chain_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        keys.append(block_key(parent))
    return keys


class BlockLog:
    def __init__(self, held: Callable[[], Iterable[bytes]], max_events: int = 1 << 16):
        """The events of a cache whose blocks now held `held()` lists (hashes; more sources: `add_held`);
        at most `max_events` kept (16 bytes of key and flag each, ~1 MiB at the default)."""
        self._held, self.max_events = [held], max_events
        self._events: list[tuple[int, bool]] = []  # (key, stored) since `_base`
        self._base = 0  # the sequence number of `_events[0]`
        self._lock = threading.Lock()

    def add_held(self, held: Callable[[], Iterable[bytes]]) -> None:
        """Count what `held()` lists as held too (a lower tier of the cache)."""
        self._held.append(held)

    @property
    def seq(self) -> int:
        """The number of the next event: a reader that saw everything asks `since(seq)`."""
        return self._base + len(self._events)

    def stored(self, block_hash: bytes) -> None:
        self._add(block_key(block_hash), True)

    def removed(self, block_hash: bytes) -> None:
        self._add(block_key(block_hash), False)

    def since(self, seq: int | None) -> BlockDelta:
        """What changed from event `seq` on (None: a reader with nothing); events before `seq` are
        dropped (one reader: the owner gathering loads). A reader behind what is kept, or ahead (a new
        process under the same name), gets a reset: every block held."""
        with self._lock:
            events, end = self._events, self.seq
            self._base, self._events = end, []
            if seq is None or not end - len(events) <= seq <= end:
                # a block logged while this is listed is in the list and in the next delta: applied twice, alike
                return BlockDelta(tuple(block_key(h) for held in self._held for h in list(held())), (), end, reset=True)
        last = dict(events[seq - (end - len(events)):])  # a block stored and evicted since: its last event counts
        return BlockDelta(tuple(k for k, s in last.items() if s), tuple(k for k, s in last.items() if not s), end)

    def _add(self, key: int, stored: bool) -> None:
        with self._lock:
            self._events.append((key, stored))
            if len(self._events) > self.max_events:  # nobody reads: whoever comes gets a reset
                self._base += len(self._events)
                self._events = []
