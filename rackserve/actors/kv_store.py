"""`KVStore`: a host-memory prefix cache actor (one per tray or node), a thin actor over `PrefixStore`,
with a local-disk tier below it when given one.

A background thread drives the store's NIXL agent (PUTs arriving, pinned reads released), polling
every millisecond while there is traffic and backing off to `TIMEOUTS.store_idle_poll_s` when there is none, so an
idle store costs next to no CPU.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import threading
import time
from pathlib import Path

import torch

from rackserve.config import EngineConfig
from rackserve.engine.prefix_store import PrefixStore
from rackserve.messages import BlockDelta
from rackserve.models import read_config, resolve
from rackserve.timeouts import TIMEOUTS
from rackserve.transfer.kv_agent import KVAgent, RemoteRegion
from rackserve.transfer.transport import StoreHit


class KVStore:
    def __init__(self, model: str = "tiny", memory_mb: float = 256.0, pool_mb: float = 64.0, inbox_mb: float = 4.0,
                 engine_kwargs: dict | None = None, name: str = "kvstore", disk_mb: float = 0.0,
                 disk_path: str | None = None):
        """`memory_mb` of cached prefixes; `pool_mb` of NIXL-registered memory for the writers'
        inboxes (`inbox_mb` each) and pinned reads; `engine_kwargs`: the ranks' (for the state layout:
        block size, and the MTP layer's state with speculative decoding); `disk_mb` of blocks evicted
        from memory kept on local disk, under `disk_path`/`name` (default: the system's temporary
        directory's rackserve-kv/), none at 0."""
        config = read_config(resolve(model))
        ranks = EngineConfig(**(engine_kwargs or {})).resolve(config)
        agent = KVAgent(f"{name}-{secrets.token_hex(4)}", int(pool_mb * 2**20))
        self.store = PrefixStore(config, ranks.block_size, agent, memory_mb, int(inbox_mb * 2**20),
                                 draft_layers=int(ranks.speculative_tokens > 0), dtype=getattr(torch, ranks.dtype),
                                 state_dtype=ranks.state_dtype, bounded_replay=ranks.bounded_replay,
                                 disk_bytes=int(disk_mb * 2**20),
                                 disk_path=str(Path(disk_path or Path(tempfile.gettempdir()) / "rackserve-kv") / name))
        self._lock = threading.Lock()
        self._busy_until = 0.0
        threading.Thread(target=self._poll_loop, daemon=True, name="kv-store-poll").start()

    def metadata(self) -> tuple[str, bytes]:
        """(this store's NIXL agent's name, its metadata)."""
        return self.store.agent.name, self.store.agent.metadata()

    def ping(self) -> int:
        """Liveness: this store's process id."""
        return os.getpid()

    def add_writer(self, metadata: bytes) -> RemoteRegion:
        """Learn a rank's agent; its inbox here."""
        with self._lock:
            return self.store.add_writer(metadata)

    def remove_writers(self, names: list[str]) -> None:
        """Forget the agents `names` of ranks that are gone (their inboxes return to the pool)."""
        with self._lock:
            for name in names:
                self.store.remove_writer(name)

    def lookup(self, token_ids: list[int]) -> StoreHit | None:
        """The longest cached prefix (`PrefixStore.lookup`), or None."""
        with self._lock:
            hit = self.store.lookup(token_ids)
            self._busy_until = time.monotonic() + TIMEOUTS.store_busy_for_s
        return hit

    def block_events(self, since: int | None) -> BlockDelta:
        """The blocks this store cached and evicted from event `since` on (`BlockLog.since`)."""
        return self.store.cache.events.since(since)

    def close(self) -> None:
        """Remove the disk tier's files (before the store is killed)."""
        with self._lock:
            self.store.close()

    def stats(self) -> dict:
        with self._lock:
            cache, disk = self.store.cache, self.store.disk
            tier = {f"disk_{k}": v for k, v in vars(disk.stats).items()} | {"disk_bytes_total": disk.capacity_bytes} \
                if disk is not None else {}
            return {**vars(self.store.stats), "bytes_in_use": cache.bytes_in_use, "bytes_total": cache.bytes_total,
                    "evictions": cache.stats.evictions, **tier, "pid": os.getpid()}

    def _poll_loop(self) -> None:
        while True:
            with self._lock:
                before = self.store.stats.puts
                self.store.poll()
                if self.store.stats.puts != before or self.store.stats.pinned:
                    self._busy_until = time.monotonic() + TIMEOUTS.store_busy_for_s
            busy = time.monotonic() < self._busy_until
            time.sleep(TIMEOUTS.store_busy_poll_s if busy else TIMEOUTS.store_idle_poll_s)
