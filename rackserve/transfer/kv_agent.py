"""Moving request state between ranks with NIXL: one agent per rank, one registered memory pool.
`KVAgent` is the `KVTransport` (`transport.py`) every engine and actor uses.

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

import logging
import time

import torch

from rackserve.transfer.transport import (
    ALIGN,
    KVReservation,
    PoolAgent,
    RemoteRegion,
    Transfer,
    TransferError,
)

# the transport's values, re-exported: the engine, the actors and the benches import them from here
__all__ = ["ALIGN", "KVAgent", "KVReservation", "RemoteRegion", "Transfer", "TransferError"]

log = logging.getLogger(__name__)

# what a NIXL status means when a transfer or notification to a known peer fails to start (our range checked)
_CAUSES = {
    "NIXL_ERR_NOT_FOUND": "no registered memory of the peer holds that range; is the region inside its pool?",
    "NIXL_ERR_REMOTE_DISCONNECT": "the peer is gone (closed, or its process ended); learn its successor's metadata",
    "NIXL_ERR_BACKEND": "UCX could not reach the peer (its process or node is gone?)",
}


def _nixl_error(what: str, e: Exception) -> TransferError:
    """`what` failed with the NIXL error `e`: the error, naming its cause where we know it."""
    return TransferError(f"{what} ({e}): {_CAUSES.get(str(e), 'NIXL logged more above')}")


class KVAgent(PoolAgent):
    def __init__(self, name: str, pool_bytes: int, device: str | torch.device = "cpu"):
        """`name`: unique among the agents that will talk to each other; `pool_bytes`: the
        registered memory, in host memory for a CPU `device`, else on that GPU."""
        from nixl._api import nixl_agent, nixl_agent_config

        super().__init__(name, pool_bytes, device)
        # no progress thread: UCX's spins a core even when idle; our engines poll every step instead
        # (`poll`, `notifications`), which is when progress is needed
        self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self._registration = self._agent.register_memory(self.pool)

    # ---- peers -------------------------------------------------------------------------------
    def metadata(self) -> bytes:
        """What a peer needs (`add_peer`) to reach this agent."""
        return self._agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        """Learn a peer from its `metadata()`; returns its name. Known peers are kept (cached). Raises
        `TransferError` if the peer cannot be reached (NIXL connects when it loads the metadata)."""
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as e:  # nixl raises its own error types from the bindings
            raise _nixl_error(f"{self.name}: a peer's metadata could not be loaded", e) from e
        name = name.decode() if isinstance(name, bytes) else name
        self._peers.add(name)
        return name

    def remove_peer(self, name: str) -> None:
        """Forget peer `name` and disconnect from it: NIXL keeps a remote agent's metadata and UCX
        endpoints until told, so without this every restarted peer would leave its predecessor's behind."""
        if name in self._peers:
            try:
                self._agent.remove_remote_agent(name)
            except Exception as e:  # noqa: BLE001 - nixl's own error types: a vanished peer may not part cleanly
                log.warning("%s: forgetting peer %r: %s", self.name, name, e)
        super().remove_peer(name)

    # ---- transfers -----------------------------------------------------------------------------
    def write(self, offset: int, remote: RemoteRegion, notif: bytes = b"") -> Transfer:
        """Start a WRITE of our pool's `[offset, offset + remote.nbytes)` into `remote`; the peer
        receives `notif` once the data is there."""
        return self._start("WRITE", offset, remote, notif)

    def read(self, offset: int, remote: RemoteRegion) -> Transfer:
        """Start a READ of `remote` into our pool at `offset`."""
        return self._start("READ", offset, remote, b"")

    def _start(self, op: str, offset: int, remote: RemoteRegion, notif: bytes) -> Transfer:
        self._check_start(offset, remote)
        local = self._agent.get_xfer_descs([(self.pool.data_ptr() + offset, remote.nbytes, self.device_id)],
                                           self.mem)
        far = self._agent.get_xfer_descs([(remote.addr, remote.nbytes, remote.device)], remote.mem)
        try:
            handle = self._agent.initialize_xfer(op, local, far, remote.agent, notif)
            state = self._agent.transfer(handle)
        except Exception as e:  # nixl raises its own error types from the bindings
            raise _nixl_error(f"{self.name}: {op} of {remote.nbytes} bytes with {remote.agent!r} at "
                              f"{remote.addr:#x} failed to start", e) from e
        if state == "ERR":
            self._agent.release_xfer_handle(handle)
            raise TransferError(f"{self.name}: {op} of {remote.nbytes} bytes with {remote.agent!r} failed to start")
        return Transfer(handle, remote.agent, remote.nbytes, time.monotonic())

    def poll(self, transfer: Transfer) -> bool:
        """True once `transfer` is done (its handle released); raises `TransferError` if it failed."""
        try:
            state = self._agent.check_xfer_state(transfer.handle)
        except Exception as e:  # nixl raises its own error types (a peer whose node is gone: REMOTE_DISCONNECT)
            self.cancel(transfer)
            raise _nixl_error(f"{self.name}: transfer of {transfer.nbytes} bytes with {transfer.peer!r} failed",
                              e) from e
        if state == "PROC":
            return False
        self._agent.release_xfer_handle(transfer.handle)
        if state != "DONE":
            raise TransferError(f"{self.name}: transfer of {transfer.nbytes} bytes with {transfer.peer!r} "
                                f"failed ({state})")
        return True

    def cancel(self, transfer: Transfer) -> None:
        """Release a transfer's handle without waiting for it (its peer is gone); NIXL aborts it if running."""
        try:
            self._agent.release_xfer_handle(transfer.handle)
        except Exception:  # noqa: BLE001 - nixl's own error types: a handle it already dropped is fine
            pass

    def notify(self, peer: str, message: bytes) -> None:
        """Send `message` to `peer` without data (e.g. "that transfer will not come")."""
        self._check_peer(peer)
        try:
            self._agent.send_notif(peer, message)
        except Exception as e:  # nixl raises its own error types from the bindings
            raise _nixl_error(f"{self.name}: notification to {peer!r} failed", e) from e

    def notifications(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call: (peer name, message), oldest first."""
        return [(peer, msg) for peer, msgs in self._agent.get_new_notifs().items() for msg in msgs]

    def close(self) -> None:
        self._agent.deregister_memory(self._registration)
