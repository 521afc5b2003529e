"""Moving request state between ranks with NIXL: one agent per rank, one registered memory pool.

    agent = KVAgent("decode-0-r1", pool_bytes=64 << 20)     # UCX; host memory (or device memory)
    peer = other.add_peer(agent.metadata())                  # once per peer (metadata through Ray)
    offset = agent.alloc(n)                                  # a range of the pool to receive into
    region = agent.region(offset, n)                         # a typed, msgpack-able descriptor
    t = other.write(src_offset, region, notif=b"...")         # one-sided WRITE + notification
    other.wait(t)  /  agent.notifications()                  # -> [(peer name, b"...")]

The pool is registered with NIXL once, at start; state travels through it (export into the pool,
one WRITE or READ of a contiguous range, import out of it), so no memory is registered per request.
Transfers are non-blocking: `write`/`read` start one, `poll`/`wait` finish it; a failure raises
`TransferError` naming the peer and the range. Agents run without UCX's progress thread (it
spins a core even when idle): a transfer advances when either end calls `poll`, `wait` or
`notifications`, so an agent's owner polls it regularly (engines do, once per step).
"""

from __future__ import annotations

import time
from dataclasses import astuple, dataclass

import torch

from rackserve.transfer.pool import RangeAllocator

ALIGN = 256  # bytes; pool ranges start on this boundary (DMA-friendly on GPUs, harmless on hosts)
PUSH_MARGIN_S = 1.0  # a push starts at least this long before its reservation expires


class TransferError(RuntimeError):
    """A NIXL transfer that failed or timed out; the message names the peer and the range."""


@dataclass(frozen=True)
class RemoteRegion:
    """A byte range of an agent's pool that a peer may WRITE into or READ from."""

    agent: str
    addr: int
    nbytes: int
    device: int  # CUDA device id, 0 for host memory
    mem: str  # "DRAM" (host) or "VRAM" (GPU)

    def to_wire(self) -> list:
        return list(astuple(self))

    @classmethod
    def from_wire(cls, fields: list) -> RemoteRegion:
        return cls(*fields)


@dataclass(frozen=True)
class KVReservation:
    """A decode rank's promise to take one request's pushed state: where to WRITE it, until when.

    expires_at: wall-clock seconds (`time.time()`); a prefill rank does not start a WRITE later than
    `expires_at - PUSH_MARGIN_S`, and the decode rank keeps the range out of use for a while after it
    expires, so a late WRITE can never land in memory given to another request.
    """

    request_id: str
    region: RemoteRegion
    expires_at: float

    def to_wire(self) -> list:
        return [self.request_id, self.region.to_wire(), self.expires_at]

    @classmethod
    def from_wire(cls, fields: list) -> KVReservation:
        return cls(fields[0], RemoteRegion.from_wire(fields[1]), fields[2])


@dataclass
class Transfer:
    """One WRITE or READ in flight."""

    handle: object
    peer: str
    nbytes: int
    started: float  # time.monotonic()


class KVAgent:
    def __init__(self, name: str, pool_bytes: int, device: str | torch.device = "cpu"):
        """`name`: unique among the agents that will talk to each other; `pool_bytes`: the
        registered memory, in host memory for a CPU `device`, else on that GPU."""
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name
        self.device = torch.device(device)
        self.mem = "VRAM" if self.device.type == "cuda" else "DRAM"
        self.device_id = (self.device.index or 0) if self.device.type == "cuda" else 0
        # no progress thread: UCX's spins a core even when idle; our engines poll every step instead
        # (`poll`, `notifications`), which is when progress is needed
        self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.pool = torch.zeros(pool_bytes, dtype=torch.uint8, device=self.device)
        self._registration = self._agent.register_memory(self.pool)
        self._alloc = RangeAllocator(pool_bytes, ALIGN)
        self._peers: set[str] = set()

    # ---- peers -------------------------------------------------------------------------------
    def metadata(self) -> bytes:
        """What a peer needs (`add_peer`) to reach this agent."""
        return self._agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        """Learn a peer from its `metadata()`; returns its name. Known peers are kept (cached)."""
        name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        self._peers.add(name)
        return name

    def knows(self, peer: str) -> bool:
        return peer in self._peers

    # ---- the pool ------------------------------------------------------------------------------
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

    # ---- transfers -----------------------------------------------------------------------------
    def write(self, offset: int, remote: RemoteRegion, notif: bytes = b"") -> Transfer:
        """Start a WRITE of our pool's `[offset, offset + remote.nbytes)` into `remote`; the peer
        receives `notif` once the data is there."""
        return self._start("WRITE", offset, remote, notif)

    def read(self, offset: int, remote: RemoteRegion) -> Transfer:
        """Start a READ of `remote` into our pool at `offset`."""
        return self._start("READ", offset, remote, b"")

    def _start(self, op: str, offset: int, remote: RemoteRegion, notif: bytes) -> Transfer:
        if remote.agent not in self._peers:
            raise TransferError(f"{self.name}: unknown peer {remote.agent!r}; add_peer(its metadata) first")
        if not 0 <= offset <= self.pool.numel() - remote.nbytes:
            raise TransferError(f"{self.name}: local range [{offset}, {offset + remote.nbytes}) is outside the "
                                f"{self.pool.numel()}-byte pool")
        local = self._agent.get_xfer_descs([(self.pool.data_ptr() + offset, remote.nbytes, self.device_id)],
                                           self.mem)
        far = self._agent.get_xfer_descs([(remote.addr, remote.nbytes, remote.device)], remote.mem)
        try:
            handle = self._agent.initialize_xfer(op, local, far, remote.agent, notif)
            state = self._agent.transfer(handle)
        except Exception as e:  # nixl raises its own error types from the bindings
            raise TransferError(f"{self.name}: {op} of {remote.nbytes} bytes with {remote.agent!r} "
                                f"failed to start: {e}") from e
        if state == "ERR":
            self._agent.release_xfer_handle(handle)
            raise TransferError(f"{self.name}: {op} of {remote.nbytes} bytes with {remote.agent!r} failed to start")
        return Transfer(handle, remote.agent, remote.nbytes, time.monotonic())

    def poll(self, transfer: Transfer) -> bool:
        """True once `transfer` is done (its handle released); raises `TransferError` if it failed."""
        state = self._agent.check_xfer_state(transfer.handle)
        if state == "PROC":
            return False
        self._agent.release_xfer_handle(transfer.handle)
        if state != "DONE":
            raise TransferError(f"{self.name}: transfer of {transfer.nbytes} bytes with {transfer.peer!r} "
                                f"failed ({state})")
        return True

    def wait(self, transfer: Transfer, timeout_s: float = 30.0) -> None:
        """Block until `transfer` is done; `TransferError` on failure or after `timeout_s`. The
        peer must make progress meanwhile (its owner polls it, as a stepping engine does)."""
        deadline = time.monotonic() + timeout_s
        while not self.poll(transfer):
            if time.monotonic() > deadline:
                raise TransferError(f"{self.name}: transfer of {transfer.nbytes} bytes with {transfer.peer!r} "
                                    f"did not finish in {timeout_s:.0f} s")

    def notify(self, peer: str, message: bytes) -> None:
        """Send `message` to `peer` without data (e.g. "that transfer will not come")."""
        self._agent.send_notif(peer, message)

    def notifications(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call: (peer name, message), oldest first."""
        return [(peer, msg) for peer, msgs in self._agent.get_new_notifs().items() for msg in msgs]

    def close(self) -> None:
        self._agent.deregister_memory(self._registration)
