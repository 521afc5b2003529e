"""Inbound half of a member's setup: authenticate the lower ranks that connect to it.

One handshake thread per accepted connection, so a stranger that stalls or sends garbage delays
nobody: it is refused and logged, and the listener keeps accepting. Once every expected peer is
in, the listener closes and half-finished handshakes are cut off.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from rackserve.collective import handshake
from rackserve.collective.errors import CollectiveError
from rackserve.collective.wire import Connection

log = logging.getLogger(__name__)


class Acceptor:
    """Accepts ``expected`` ranks on ``listener`` until ``deadline`` (monotonic seconds).

    ``refused`` counts the connections turned away (wrong secret, garbage, unexpected rank).
    """

    def __init__(self, listener: socket.socket, key: bytes, rank: int, world: int, expected: set[int],
                 deadline: float, handshake_timeout: float, max_frame_bytes: int):
        self.rank, self.refused = rank, 0
        self._listener, self._key, self._world, self._expected = listener, key, world, expected
        self._deadline, self._handshake_timeout = deadline, handshake_timeout
        self._max_frame_bytes = max_frame_bytes
        self._cond = threading.Condition()
        self._claimed: set[int] = set()
        self._ready: dict[int, Connection] = {}
        self._pending: set[socket.socket] = set()
        self._stopped = False
        listener.settimeout(0.05)  # lets the accept loop notice stop() promptly
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"collective-accept-{rank}")
        self._thread.start()

    def wait(self) -> dict[int, Connection]:
        """The authenticated inbound connections, once all expected peers are in."""
        with self._cond:
            while len(self._ready) < len(self._expected):
                remaining = self._deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(self._expected - self._ready.keys())
                    raise CollectiveError(
                        f"rank {self.rank}: rank(s) {missing} did not connect in time; are "
                        "they running with the same peer table and secret?", tuple(missing))
                self._cond.wait(remaining)
            ready, self._ready = self._ready, {}
            return ready

    def stop(self) -> None:
        """Close the listener and refuse whatever is still half-way through a handshake."""
        with self._cond:
            self._stopped = True
            for sock in self._pending:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes its handshake thread at once
                except OSError:
                    pass
            for conn in self._ready.values():  # only non-empty if setup failed
                conn.close()
        self._thread.join()
        self._listener.close()

    def _accept_loop(self) -> None:
        while not self._stopped and time.monotonic() < self._deadline:
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._cond:
                if self._stopped:
                    sock.close()
                    return
                self._pending.add(sock)
            threading.Thread(target=self._handshake, args=(sock, addr), daemon=True).start()

    def _claim(self, peer: int) -> bool:
        with self._cond:
            if peer in self._expected and peer not in self._claimed:
                self._claimed.add(peer)
                return True
            return False

    def _handshake(self, sock: socket.socket, addr) -> None:
        conn = Connection(sock, None)
        try:
            deadline = min(self._deadline, time.monotonic() + self._handshake_timeout)
            peer = handshake.accept(conn, self._key, self._world, self.rank, self._claim, deadline,
                                    self._max_frame_bytes)
        except Exception as e:  # anything a stranger's bytes can provoke: refuse, keep serving
            log.warning("rank %d refused a connection from %s: %s", self.rank, addr, e)
            with self._cond:
                self.refused += 1
                self._pending.discard(sock)
            conn.close()
            return
        with self._cond:
            self._pending.discard(sock)
            if self._stopped:
                conn.close()
            else:
                self._ready[peer] = conn
                self._cond.notify_all()
