"""Agents of one process that move state by memory copies: the reference `KVTransport`, so the P/D
logic runs in a test in milliseconds, without NIXL.

    a, b = LocalAgent("prefill-0", 8 << 20), LocalAgent("decode-0", 8 << 20)
    a.add_peer(b.metadata())                       # the same calls as with KVAgent
    t = a.write(src, b.region(dst, n), notif=b"…")  # queued: nothing moves yet
    b.notifications()                              # progress: the bytes land, then [("prefill-0", b"…")]
    a.poll(t)                                      # -> True

Agents find each other by name in one registry per process (a name is unique among open agents; a
closed agent leaves it and is gone: transfers to or from it fail). A WRITE, READ or notification is
queued when started and carried out, in the order started, when either end progresses (`poll`, `wait`,
`notifications`), as NIXL does without a progress thread: code that reuses a source range before its
WRITE is done, or looks for data before polling, fails here as it would there. One lock guards the
registry and the queue, for agents driven from several threads (as an actor's poll thread does).
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass

import torch

from rackserve.transfer.transport import PoolAgent, RemoteRegion, Transfer, TransferError

_METADATA = b"rackserve-local-agent:"  # + the agent's name

_lock = threading.Lock()  # guards the two below and every agent's inbox
_agents: weakref.WeakValueDictionary[str, LocalAgent] = weakref.WeakValueDictionary()  # the open ones, by name
_queue: list[_Op] = []  # started, not carried out yet, oldest first


@dataclass(eq=False)
class _Op:
    """A WRITE, READ or bare notification ("NOTIF", no bytes) started by `initiator`, waiting for an end
    to progress; `state` goes from "PROC" to "DONE", or to "ERR" with the cause in `error`."""

    kind: str
    initiator: str
    local: torch.Tensor  # the initiator's bytes, uint8 [nbytes]
    peer: str
    far: int  # offset of the range in the peer's pool
    notif: bytes
    state: str = "PROC"
    error: str = ""

    def run(self) -> None:
        source, target = _agents.get(self.initiator), _agents.get(self.peer)
        if source is None or target is None:
            self.state, self.error = "ERR", f"{self.initiator if source is None else self.peer!r} is gone (closed)"
            return
        far = target.pool[self.far:self.far + self.local.numel()]
        if self.kind == "WRITE":
            far.copy_(self.local)
        elif self.kind == "READ":
            self.local.copy_(far)
        if self.notif:
            target._inbox.append((self.initiator, self.notif))
        self.state = "DONE"



class LocalAgent(PoolAgent):
    def __init__(self, name: str, pool_bytes: int, device: str | torch.device = "cpu"):
        """`name`: unique among this process's open agents; `pool_bytes`: the pool, in host memory for a
        CPU `device`, else on that GPU."""
        super().__init__(name, pool_bytes, device)
        self._inbox: list[tuple[str, bytes]] = []  # delivered notifications, oldest first
        with _lock:
            if name in _agents:
                raise ValueError(f"a LocalAgent named {name!r} is open in this process; pick another name "
                                 "or close that agent first")
            _agents[name] = self

    def metadata(self) -> bytes:
        return _METADATA + self.name.encode()

    def add_peer(self, metadata: bytes) -> str:
        if not metadata.startswith(_METADATA):
            raise TransferError(f"{self.name}: {metadata[:40]!r}… is not a LocalAgent's metadata (a NIXL agent's?); "
                                "local agents reach only local agents of this process")
        name = metadata[len(_METADATA):].decode()
        self._peers.add(name)
        return name

    def write(self, offset: int, remote: RemoteRegion, notif: bytes = b"") -> Transfer:
        return self._start("WRITE", offset, remote, notif)

    def read(self, offset: int, remote: RemoteRegion) -> Transfer:
        return self._start("READ", offset, remote, b"")

    def _start(self, kind: str, offset: int, remote: RemoteRegion, notif: bytes) -> Transfer:
        self._check_start(offset, remote)
        failed = (f"{self.name}: {kind} of {remote.nbytes} bytes with {remote.agent!r} at {remote.addr:#x} "
                  "failed to start")
        with _lock:
            target = _agents.get(remote.agent)
            if target is None:
                raise TransferError(f"{failed}: the peer is gone (closed); learn its successor's metadata")
            far = remote.addr - target.pool.data_ptr()
            if not 0 <= far <= target.pool.numel() - remote.nbytes:
                raise TransferError(f"{failed}: the region is not inside the peer's {target.pool.numel()}-byte "
                                    "pool; take regions from its `region`")
            op = _Op(kind, self.name, self.view(offset, remote.nbytes), remote.agent, far, notif)
            _queue.append(op)
        return Transfer(op, remote.agent, remote.nbytes, time.monotonic())

    def poll(self, transfer: Transfer) -> bool:
        self._progress()
        op = transfer.handle
        if op.state == "ERR":
            raise TransferError(f"{self.name}: {op.kind} of {transfer.nbytes} bytes with {transfer.peer!r} "
                                f"failed: {op.error}")
        return op.state == "DONE"

    def cancel(self, transfer: Transfer) -> None:
        with _lock:
            if transfer.handle in _queue:
                _queue.remove(transfer.handle)
        transfer.handle.state, transfer.handle.error = "ERR", "cancelled"

    def notify(self, peer: str, message: bytes) -> None:
        self._check_peer(peer)
        with _lock:
            if peer not in _agents:
                raise TransferError(f"{self.name}: notification to {peer!r} failed: the peer is gone (closed)")
            _queue.append(_Op("NOTIF", self.name, self.pool[:0], peer, 0, message))

    def notifications(self) -> list[tuple[str, bytes]]:
        self._progress()
        with _lock:
            got, self._inbox = self._inbox, []
        return got

    def close(self) -> None:
        with _lock:
            if _agents.get(self.name) is self:
                del _agents[self.name]
        self._progress()  # what is queued to or from this agent fails now

    def _progress(self) -> None:
        """Carry out, in order, every queued operation this agent is an end of."""
        with _lock:
            keep = []
            for op in _queue:
                if self.name in (op.initiator, op.peer):
                    op.run()
                else:
                    keep.append(op)
            _queue[:] = keep
