"""Rendezvous: members publish where they listen; a coordinator hands everyone the peer table.

For plain processes (tests, benchmarks): run a ``RendezvousServer`` in one process, then in each
member ``join(server.address, rank, world, secret)``. A Ray layer needs none of this: each actor
binds ``wire.listen()``, reports its address to the controller, and builds
``Communicator(..., peers=table, listener=sock)`` once the controller passes the table around.

Members prove the group secret to the coordinator (and it to them) with the same handshake peers
use, so a stranger can neither register a bogus address nor hand out a bogus table.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import msgpack

from rackserve.collective import handshake
from rackserve.collective.communicator import Communicator
from rackserve.collective.errors import CollectiveError
from rackserve.collective.handshake import COORDINATOR
from rackserve.collective.wire import Connection, dial, encode_header, listen

log = logging.getLogger(__name__)
_MAX_MESSAGE_BYTES = 1 << 20  # a table of 1024+ (host, port) entries fits easily


def _send(conn: Connection, op: str, value, deadline: float) -> None:
    payload = msgpack.packb(value)
    conn.send(encode_header(op, 0, "", (), len(payload)), payload, deadline)


class RendezvousServer:
    """Collects ``world_size`` members' (host, port) and sends each member the full table.

    Serves in a background thread of the process that owns the group. If some rank has not
    registered within ``timeout`` seconds, the registered members get an error naming it.
    """

    def __init__(self, world_size: int, secret: bytes | str, host: str = "127.0.0.1",
                 port: int = 0, timeout: float = 60.0):
        if world_size < 1:
            raise ValueError(f"world size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._key = handshake.secret_bytes(secret)
        self._deadline = time.monotonic() + timeout
        self._listener = listen(host, port)
        self._listener.settimeout(0.05)  # lets the accept loop notice close() promptly
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._cond = threading.Condition()
        self._claimed: set[int] = set()
        self._members: dict[int, tuple[Connection, tuple[str, int]]] = {}
        self._table: list[tuple[str, int]] | None = None
        self._error: str | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._serve, daemon=True, name="collective-rendezvous")
        self._thread.start()

    def peers(self, timeout: float | None = None) -> list[tuple[str, int]]:
        """The peer table, once every member registered (for a driver that wants it too)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._table or self._error, timeout):
                raise CollectiveError(f"rendezvous at {self.address}: no complete peer table "
                                      f"within {timeout} s")
            if self._error:
                raise CollectiveError(self._error)
            return list(self._table)

    def close(self) -> None:
        with self._cond:
            self._closed = True
        self._thread.join()

    def __enter__(self) -> RendezvousServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _serve(self) -> None:
        try:
            while not self._closed and self._table is None and time.monotonic() < self._deadline:
                try:
                    sock, addr = self._listener.accept()
                except TimeoutError:
                    continue
                threading.Thread(target=self._register, args=(sock, addr), daemon=True).start()
        finally:
            self._listener.close()
            with self._cond:
                if self._table is None:
                    missing = sorted(set(range(self.world_size)) - self._members.keys())
                    self._error = (f"rendezvous at {self.address}: rank(s) {missing} did not "
                                   "register in time; did they start, with the same secret?")
                    self._cond.notify_all()
                members, self._members = dict(self._members), {}
            self._finish(members)

    def _claim(self, rank: int) -> bool:
        with self._cond:
            if 0 <= rank < self.world_size and rank not in self._claimed:
                self._claimed.add(rank)
                return True
            return False

    def _register(self, sock: socket.socket, addr) -> None:
        conn = Connection(sock, None)
        try:
            deadline = self._deadline
            rank = handshake.accept(conn, self._key, self.world_size, COORDINATOR, self._claim,
                                    deadline, _MAX_MESSAGE_BYTES)
            frame = conn.recv(deadline)
            host, port = msgpack.unpackb(frame.payload, raw=False)
            if frame.op != "register" or not isinstance(host, str) or type(port) is not int:
                raise ValueError(f"bad registration {frame.op!r}")
        except Exception as e:  # a stranger or a broken member: refuse it, keep serving
            log.warning("rendezvous refused a connection from %s: %s", addr, e)
            conn.close()
            return
        with self._cond:
            self._members[rank] = (conn, (host, port))
            if len(self._members) == self.world_size:
                self._table = [self._members[r][1] for r in range(self.world_size)]
                self._cond.notify_all()

    def _finish(self, members: dict[int, tuple[Connection, tuple[str, int]]]) -> None:
        """Send every registered member the table (or the error), then hang up."""
        deadline = time.monotonic() + 10.0
        for conn, _ in members.values():
            try:
                if self._table is not None:
                    _send(conn, "table", self._table, deadline)
                else:
                    _send(conn, "error", self._error, deadline)
            except CollectiveError as e:
                log.warning("rendezvous could not answer %s: %s", conn.name, e)
            conn.close()


def rendezvous(address: tuple[str, int], rank: int, world_size: int, secret: bytes | str, *,
               host: str = "127.0.0.1", timeout: float = 60.0) -> tuple[list[tuple[str, int]], socket.socket]:
    """Publish this member's address at the coordinator and return ``(peers, listener)``.

    Binds the listener on (``host``, a free port) *before* registering, so by the time anyone
    has the table every member is already listening. Pass both to ``Communicator``.
    """
    key = handshake.secret_bytes(secret)
    deadline = time.monotonic() + timeout
    listener = listen(host, 0)
    try:
        try:
            conn = Connection(dial(*address, deadline), COORDINATOR, _MAX_MESSAGE_BYTES)
        except OSError as e:
            raise CollectiveError(f"rank {rank} could not reach the rendezvous at "
                                  f"{address[0]}:{address[1]} ({e}); is the coordinator running?") from None
        try:
            handshake.connect(conn, key, world_size, rank, COORDINATOR, deadline, _MAX_MESSAGE_BYTES)
            _send(conn, "register", list(listener.getsockname()[:2]), deadline)
            frame = conn.recv(deadline)
        finally:
            conn.close()
        value = msgpack.unpackb(frame.payload, raw=False)
        if frame.op == "error":
            raise CollectiveError(f"rank {rank}: {value}")
        return [(str(h), int(p)) for h, p in value], listener
    except BaseException:
        listener.close()
        raise


def join(address: tuple[str, int], rank: int, world_size: int, secret: bytes | str,
         timeout: float = 30.0, *, host: str = "127.0.0.1", rendezvous_timeout: float = 60.0,
         **options) -> Communicator:
    """Rendezvous, then build this member's Communicator (``options`` go to its constructor)."""
    peers, listener = rendezvous(address, rank, world_size, secret, host=host, timeout=rendezvous_timeout)
    return Communicator(rank, world_size, peers, secret, timeout, listener=listener, **options)
