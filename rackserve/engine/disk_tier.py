"""A local-disk tier under a host-memory prefix cache: the blocks it evicts, kept in files, LRU.

A `StateCache` with a lower tier (`StateCache.lower`) hands it every cached block it evicts
(`spill`: the block's bytes, `PagedState.block_bytes`, with its snapshot's slot rows if it had one)
and, when a lookup's chain of cached blocks breaks, asks it for the next block (`take`), which moves
back into host memory. The tiers are exclusive: a block lives in one of them, so the disk adds its
capacity to the host's.

* Writes are asynchronous: `spill` queues the bytes (at most `queue_bytes` waiting; more are dropped,
  counted) and a thread writes one file per block (`<hash>.blk`: a header with a CRC-32 of the
  bytes, then the bytes; written under a temporary name and renamed, so a file is whole or absent).
  A block still queued is taken from the queue.
* Reads are synchronous, in the lookup that needs them, and checked: a file missing, short, or
  failing its checksum is a miss (counted, the file dropped), never an error.
* `capacity_bytes` bounds the files' bytes; the least recently spilled block goes first, and its
  removal is reported (`on_removed`) so that routers stop counting it.
* A disk that fails a write (full, read-only, gone) degrades the tier to nothing with one warning and
  `stats.degraded`: blocks are then dropped as a host-only cache drops them; requests never fail.

The directory is this tier's alone and emptied at start: blocks of an earlier process are not trusted.
"""

from __future__ import annotations

import logging
import shutil
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<4sBxxxIQ")  # magic, flags (1: with a snapshot), CRC-32 of the bytes, their length
_MAGIC = b"RSKV"


@dataclass
class DiskStats:
    spills: int = 0  # blocks written
    spill_bytes: int = 0
    dropped: int = 0  # blocks not written: the queue full, or the tier degraded
    hits: int = 0  # blocks read back into host memory
    hit_bytes: int = 0
    read_errors: int = 0  # files missing, short or failing their checksum: misses
    evictions: int = 0  # blocks removed for room
    bytes_in_use: int = 0  # in files
    bytes_queued: int = 0  # waiting to be written
    degraded: int = 0  # 1 once a write failed: the tier holds nothing more


class DiskTier:
    def __init__(self, path: str | Path, capacity_bytes: int, queue_bytes: int = 64 << 20,
                 on_removed: Callable[[bytes], None] = lambda block_hash: None):
        """Files under `path` (created, emptied) up to `capacity_bytes`; `queue_bytes` of blocks at most
        waiting to be written; `on_removed(hash)` for each block the tier drops for room or loses."""
        if capacity_bytes <= 0:
            raise ValueError(f"a disk tier of {capacity_bytes} bytes holds nothing; give it a positive size "
                             "or none at all")
        self.path, self.capacity_bytes, self.queue_bytes = Path(path), capacity_bytes, queue_bytes
        self.on_removed = on_removed
        shutil.rmtree(self.path, ignore_errors=True)
        self.path.mkdir(parents=True)
        self.stats = DiskStats()
        self._files: OrderedDict[bytes, tuple[int, bool]] = OrderedDict()  # hash -> (bytes, snapshot), oldest first
        self._queue: OrderedDict[bytes, tuple[torch.Tensor, bool]] = OrderedDict()  # to write, oldest first
        self._lock = threading.Condition()
        self._closed = False
        self._busy = False  # the writer is on a block (the queue may be empty already)
        self._writer = threading.Thread(target=self._write_loop, daemon=True, name="kv-disk-writer")
        self._writer.start()

    # ---- the host cache's side ---------------------------------------------------------------------
    def spill(self, block_hash: bytes, data: torch.Tensor, snapshot: bool) -> bool:
        """Keep block `block_hash` (`data`: uint8, the tier keeps it; `snapshot`: it holds one):
        queued for writing. False when it is dropped instead (the caller reports it gone)."""
        with self._lock:
            size = data.numel()
            if self.stats.degraded or size > self.capacity_bytes or self.stats.bytes_queued + size > self.queue_bytes:
                self.stats.dropped += 1
                return False
            old = self._queue.pop(block_hash, None)
            if old is not None:
                self.stats.bytes_queued -= old[0].numel()
            written = self._files.pop(block_hash, None)  # an older copy: the new file replaces it
            if written is not None:
                self.stats.bytes_in_use -= written[0]
            self._queue[block_hash] = (data, snapshot)
            self.stats.bytes_queued += size
            self._lock.notify()
        return True

    def take(self, block_hash: bytes) -> tuple[torch.Tensor, bool] | None:
        """Block `block_hash`'s (bytes, snapshot) out of this tier, or None if it holds no good copy."""
        with self._lock:
            queued = self._queue.pop(block_hash, None)
            if queued is not None:
                self.stats.bytes_queued -= queued[0].numel()
                self._hit(queued[0])
                return queued
            entry = self._files.pop(block_hash, None)
            if entry is None:
                return None
            self.stats.bytes_in_use -= entry[0]
        data = self._read(block_hash, *entry)
        with self._lock:
            if data is None:
                self.stats.read_errors += 1
            else:
                self._hit(data)
        if data is None:
            self.on_removed(block_hash)
            return None
        return data, entry[1]

    def discard(self, hashes: list[bytes]) -> None:
        """Forget these blocks quietly: the host cache holds them again (a new copy was put)."""
        with self._lock:
            for h in hashes:
                queued = self._queue.pop(h, None)
                if queued is not None:
                    self.stats.bytes_queued -= queued[0].numel()
                entry = self._files.pop(h, None)
                if entry is not None:
                    self.stats.bytes_in_use -= entry[0]
                    self._file(h).unlink(missing_ok=True)

    def keys(self) -> list[bytes]:
        """Every block this tier holds (written or queued)."""
        with self._lock:
            return [*self._files, *self._queue]

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued block is written (or dropped); False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._queue and not self._busy, timeout_s)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._writer.join(timeout=5)
        shutil.rmtree(self.path, ignore_errors=True)

    # ---- internals -----------------------------------------------------------------------------------
    def _hit(self, data: torch.Tensor) -> None:
        self.stats.hits += 1
        self.stats.hit_bytes += data.numel()

    def _file(self, block_hash: bytes) -> Path:
        return self.path / f"{block_hash.hex()}.blk"

    def _write_loop(self) -> None:
        # `on_removed` is called outside the lock: the cache's event log, under its own lock, lists `keys()`
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                block_hash, (data, snapshot) = next(iter(self._queue.items()))
                self._busy = True
                size, removed = data.numel(), []
                while self._files and self.stats.bytes_in_use + size > self.capacity_bytes:
                    old, (nbytes, _) = self._files.popitem(last=False)
                    self.stats.bytes_in_use -= nbytes
                    self.stats.evictions += 1
                    removed.append(old)
            try:
                for old in removed:
                    self._file(old).unlink(missing_ok=True)
                    self.on_removed(old)
                try:
                    self._write(block_hash, data, snapshot)
                except OSError as e:
                    self._degrade(e)
                    continue
                with self._lock:
                    written = self._queue.get(block_hash, (None,))[0] is data  # not taken or replaced meanwhile
                    if written:
                        del self._queue[block_hash]
                        self.stats.bytes_queued -= size
                        self._files[block_hash] = (size, snapshot)
                        self.stats.bytes_in_use += size
                        self.stats.spills += 1
                        self.stats.spill_bytes += size
                if not written:
                    self._file(block_hash).unlink(missing_ok=True)
            finally:
                with self._lock:
                    self._busy = False
                    self._lock.notify_all()

    def _write(self, block_hash: bytes, data: torch.Tensor, snapshot: bool) -> None:
        payload = data.numpy().tobytes()
        tmp = self._file(block_hash).with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(_MAGIC, int(snapshot), zlib.crc32(payload), len(payload)))
                f.write(payload)
            tmp.replace(self._file(block_hash))
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def _read(self, block_hash: bytes, nbytes: int, snapshot: bool) -> torch.Tensor | None:
        file = self._file(block_hash)
        try:
            raw = file.read_bytes()
        except OSError as e:
            log.warning("the KV store's disk tier could not read %s (%s): a miss", file, e)
            return None
        file.unlink(missing_ok=True)
        if len(raw) >= _HEADER.size:
            magic, flags, crc, length = _HEADER.unpack_from(raw)
            payload = raw[_HEADER.size:]
            if (magic, flags, length, len(payload)) == (_MAGIC, int(snapshot), nbytes, nbytes) and \
                    zlib.crc32(payload) == crc:
                return torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        log.warning("the KV store's disk tier found %s damaged (bad header, length or checksum): a miss", file)
        return None

    def _degrade(self, error: OSError) -> None:
        """A write failed: hold nothing more (what is queued is dropped, the files stay readable)."""
        with self._lock:
            self.stats.degraded = 1
            lost = list(self._queue)
            self.stats.dropped += len(lost)
            self._queue.clear()
            self.stats.bytes_queued = 0
        log.warning("the KV store's disk tier at %s failed a write (%s): it serves from host memory only from now "
                    "on; free or fix the disk and restart the store to use it again", self.path, error)
        for h in lost:
            self.on_removed(h)
