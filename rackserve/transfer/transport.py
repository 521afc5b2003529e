"""What the engine needs of a transport for request state (`KVTransport`), the values that name state
across agents, and the pool half every implementation shares (`PoolAgent`).

Implementations: `rackserve.transfer.kv_agent.KVAgent` (NIXL over UCX, between processes and machines; the
default everywhere) and `rackserve.transfer.local.LocalAgent` (memory copies between agents of one
process, for tests of the P/D logic). `tests/test_kv_transport.py` pins the semantics both keep:

* An agent owns one pool of `pool_bytes` bytes; `alloc`/`free` hand out ranges of it (aligned to
  `ALIGN`), `view` reads and writes them in place, `region` names one to a peer.
* Peers are learnt from their `metadata()` (`add_peer`). `write` and `read` start a one-sided copy
  between a range of our pool and a peer's region; `poll`/`wait` finish it, raising `TransferError`
  (naming the peer and the cause) when it fails: unknown or gone peer, range outside either pool.
* A `write` with a non-empty `notif` delivers it to the peer once the bytes are there; `notify` sends
  one without data. Each notification arrives once; those of one kind (riding on WRITEs, or sent by
  `notify`) arrive in the order the sender sent them.
* Nothing advances by itself: transfers and notifications progress when their ends call `poll`,
  `wait` or `notifications`, so an agent's owner polls it regularly (engines do, once per step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from rackserve.transfer.pool import RangeAllocator

ALIGN = 256  # bytes; pool ranges start on this boundary (DMA-friendly on GPUs, harmless on hosts)


class TransferError(RuntimeError):
    """A transfer that could not start, failed or timed out; the message names the peer and the cause."""


@dataclass(frozen=True)
class RemoteRegion:
    """A byte range of an agent's pool that a peer may WRITE into or READ from."""

    agent: str
    addr: int  # the range's address in the owner's memory (bytes)
    nbytes: int
    device: int  # CUDA device id, 0 for host memory
    mem: str  # "DRAM" (host) or "VRAM" (GPU)


@dataclass(frozen=True)
class StoreHit:
    """A KV store's answer to a lookup: the state of the prompt's first `num_tokens` tokens (whole
    blocks) to READ at `region`, and `resume_at`: where the reader's prefill goes on. `num_tokens`
    when the prefix ends at a snapshot; earlier when it does not, by the tokens the reader replays over
    the blocks read to rebuild its slot (`PagedState.rebuild_tokens`, or bounded replay's window)."""

    num_tokens: int
    region: RemoteRegion
    resume_at: int


@dataclass(frozen=True)
class KVReservation:
    """A decode rank's promise to take one request's pushed state: where to WRITE it, until when.

    expires_at: wall-clock seconds (`time.time()`); a prefill rank does not start a WRITE later than
    `expires_at - TIMEOUTS.push_margin_s`, and the decode rank keeps the range out of use for a while after it
    expires, so a late WRITE can never land in memory given to another request.
    """

    request_id: str
    region: RemoteRegion
    expires_at: float


@dataclass
class Transfer:
    """One WRITE or READ in flight."""

    handle: object  # the implementation's own
    peer: str
    nbytes: int
    started: float  # time.monotonic()


@runtime_checkable
class KVTransport(Protocol):
    """One rank's agent: a registered pool, its peers, one-sided transfers and notifications."""

    name: str  # unique among the agents that talk to each other

    def metadata(self) -> bytes:
        """What a peer needs (`add_peer`) to reach this agent."""

    def add_peer(self, metadata: bytes) -> str:
        """Learn a peer from its `metadata()`; its name."""

    def remove_peer(self, name: str) -> None:
        """Forget peer `name` (gone: its process ended, a successor has another name) and whatever
        connection to it is held; transfers to it cannot start any more. Unknown names are ignored."""

    def cancel(self, transfer: Transfer) -> None:
        """Give up `transfer` (its peer is gone) and release its handle; poll it no more."""

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a new range of `nbytes` (> 0) of the pool, or None while the pool is full."""

    def free(self, offset: int) -> None:
        """Return the range at `offset` (from `alloc`); ValueError for any other offset."""

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """The pool's bytes `[offset, offset + nbytes)`, uint8 `[nbytes]`, in place (no copy)."""

    def region(self, offset: int, nbytes: int) -> RemoteRegion:
        """`[offset, offset + nbytes)` of our pool, named for a peer to WRITE into or READ from."""

    def write(self, offset: int, remote: RemoteRegion, notif: bytes = b"") -> Transfer:
        """Start copying our `[offset, offset + remote.nbytes)` into `remote`; a non-empty `notif`
        reaches the peer once the bytes are there. `TransferError` if it cannot start."""

    def read(self, offset: int, remote: RemoteRegion) -> Transfer:
        """Start copying `remote` into our pool at `offset`. `TransferError` if it cannot start."""

    def poll(self, transfer: Transfer) -> bool:
        """Progress; True once `transfer` is done (poll it no more then); `TransferError` if it failed."""

    def wait(self, transfer: Transfer, timeout_s: float = 30.0) -> None:
        """Block until `transfer` is done; `TransferError` on failure or after `timeout_s` seconds."""

    def notify(self, peer: str, message: bytes) -> None:
        """Send `message` to `peer` without data; `TransferError` if the peer cannot be reached."""

    def notifications(self) -> list[tuple[str, bytes]]:
        """Progress; the notifications received since the last call: (peer name, message), oldest first."""

    def close(self) -> None:
        """Release the pool; the agent is not used afterwards."""


class PoolAgent:
    """What every implementation shares: the pool (`pool_bytes` of host memory for a CPU `device`,
    else of that GPU), its ranges and regions, and `wait` on top of the subclass's `poll`."""

    def __init__(self, name: str, pool_bytes: int, device: str | torch.device = "cpu"):
        self.name = name
        self.device = torch.device(device)
        self.mem = "VRAM" if self.device.type == "cuda" else "DRAM"
        self.device_id = (self.device.index or 0) if self.device.type == "cuda" else 0
        self.pool = torch.zeros(pool_bytes, dtype=torch.uint8, device=self.device)
        self._alloc = RangeAllocator(pool_bytes, ALIGN)
        self._peers: set[str] = set()  # names from add_peer

    def knows(self, peer: str) -> bool:
        return peer in self._peers

    def remove_peer(self, name: str) -> None:
        self._peers.discard(name)

    def alloc(self, nbytes: int) -> int | None:
        """A range of `nbytes` of the pool; its offset, or None while the pool is full."""
        return self._alloc.alloc(nbytes)

    def free(self, offset: int) -> None:
        self._alloc.free(offset)

    @property
    def bytes_free(self) -> int:
        return self._alloc.bytes_free

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """The pool's bytes `[offset, offset + nbytes)` as a uint8 tensor (no copy)."""
        return self.pool[offset:offset + nbytes]

    def region(self, offset: int, nbytes: int) -> RemoteRegion:
        return RemoteRegion(self.name, self.pool.data_ptr() + offset, nbytes, self.device_id, self.mem)

    def _check_peer(self, peer: str) -> None:
        if peer not in self._peers:
            raise TransferError(f"{self.name}: unknown peer {peer!r}; add_peer(its metadata) first")

    def _check_start(self, offset: int, remote: RemoteRegion) -> None:
        """`TransferError` unless `remote` belongs to a known peer and our range for it lies in our pool."""
        self._check_peer(remote.agent)
        if not 0 <= offset <= self.pool.numel() - remote.nbytes:
            raise TransferError(f"{self.name}: local range [{offset}, {offset + remote.nbytes}) is outside the "
                                f"{self.pool.numel()}-byte pool")

    def wait(self, transfer: Transfer, timeout_s: float = 30.0) -> None:
        """Block until `transfer` is done; `TransferError` on failure or after `timeout_s`. The
        peer must make progress meanwhile (its owner polls it, as a stepping engine does)."""
        deadline = time.monotonic() + timeout_s
        while not self.poll(transfer):
            if time.monotonic() > deadline:
                raise TransferError(f"{self.name}: transfer of {transfer.nbytes} bytes with {transfer.peer!r} "
                                    f"did not finish in {timeout_s:.0f} s")
