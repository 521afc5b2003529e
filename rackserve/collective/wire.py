"""Frames on a TCP stream: a msgpack header, then raw payload bytes. Never pickle.

A frame on the wire is::

    u32 big-endian header length | msgpack [op, seq, dtype, shape, nbytes] | nbytes payload bytes

``op`` names the call ("allreduce.sum", "broadcast.3", ...), ``seq`` is the caller's call
counter, ``dtype``/``shape`` describe an array payload ("" / [] for msgpack payloads). Limits on
the header and payload sizes are checked *before* anything is allocated, so a stranger or a
corrupt peer cannot make a member allocate gigabytes.

Every wait is bounded by an absolute ``time.monotonic()`` deadline; sockets are non-blocking and
waited on with poll(), so one stalled peer never blocks a member past its deadline.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from typing import NamedTuple

import msgpack

from rackserve.collective.errors import CollectiveError

_PREFIX = struct.Struct("!I")
MAX_HEADER_BYTES = 4096  # a header is ~30 bytes plus 9 per dimension
DEFAULT_MAX_FRAME_BYTES = 1 << 30  # 1 GiB: far above a per-step sync, far below harm
_RECV_CHUNK = 1 << 16


class Frame(NamedTuple):
    op: str
    seq: int
    dtype: str
    shape: tuple[int, ...]
    payload: bytearray  # writable, so a received array can be reduced into in place


def encode_header(op: str, seq: int, dtype: str, shape: tuple[int, ...], nbytes: int) -> bytes:
    """Length prefix + msgpack header for a frame whose payload has ``nbytes`` bytes."""
    header = msgpack.packb([op, seq, dtype, list(shape), nbytes])
    return _PREFIX.pack(len(header)) + header


def _decode_header(data: bytes) -> tuple[str, int, str, tuple[int, ...], int]:
    """Parse and type-check a header; ValueError on anything malformed."""
    try:
        fields = msgpack.unpackb(data, raw=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ValueError(f"undecodable header ({type(e).__name__})") from None
    if not (isinstance(fields, list) and len(fields) == 5):
        raise ValueError("header is not a 5-field list")
    op, seq, dtype, shape, nbytes = fields
    ints = [seq, nbytes, *shape] if isinstance(shape, list) else None
    if (not isinstance(op, str) or not isinstance(dtype, str) or ints is None
            or not all(type(v) is int and v >= 0 for v in ints)):
        raise ValueError("header fields have the wrong types")
    return op, seq, dtype, tuple(shape), nbytes


def _advance(views: list[memoryview], sent: int) -> list[memoryview]:
    """Drop the first ``sent`` bytes from a scatter list after a partial sendmsg."""
    while views and sent >= len(views[0]):
        sent -= len(views[0])
        views = views[1:]
    if views and sent:
        views = [views[0][sent:], *views[1:]]
    return views


class Connection:
    """One TCP stream to one peer. ``peer``: its rank; -1 for the rendezvous coordinator; None
    while an inbound connection has not yet proven who it is.

    Not thread-safe: one thread drives it. Any failure raises CollectiveError naming the peer.
    """

    def __init__(self, sock: socket.socket, peer: int | None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small frames go out now
        sock.setblocking(False)
        self.sock = sock
        self.peer = peer
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()  # received bytes of headers not yet parsed (may hold a next frame)
        self._header: tuple | None = None  # parsed header of the frame being received
        self._payload = bytearray()
        self._filled = 0
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)

    @property
    def name(self) -> str:
        if self.peer is None:
            return "an unauthenticated client"
        return "the coordinator" if self.peer < 0 else f"rank {self.peer}"

    def _fault(self, reason: str) -> CollectiveError:
        known = self.peer is not None and self.peer >= 0
        return CollectiveError(f"{self.name} {reason}", ranks=(self.peer,) if known else ())

    def send(self, header: bytes, payload=b"", deadline: float = float("inf")) -> None:
        """Send one frame (``header`` from encode_header) before ``deadline``."""
        self._transfer(_views(header, payload), False, deadline)

    def recv(self, deadline: float) -> Frame:
        """Receive the next frame before ``deadline``."""
        return self._transfer([], True, deadline)

    def exchange(self, header: bytes, payload, deadline: float) -> Frame:
        """Send a frame and receive one at the same time, so two peers exchanging frames larger
        than their socket buffers cannot deadlock."""
        return self._transfer(_views(header, payload), True, deadline)

    def send_nowait(self, header: bytes, payload=b"") -> None:
        """Best-effort send of a small frame without waiting; used for abort notices only."""
        try:
            self.sock.sendmsg(_views(header, payload))
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()

    def _transfer(self, out: list[memoryview], want: bool, deadline: float) -> Frame | None:
        frame = None
        while True:
            if out:
                try:
                    out = _advance(out, self.sock.sendmsg(out))
                except BlockingIOError:
                    pass
                except OSError as e:
                    raise self._fault(f"dropped the connection while we were sending ({e}); "
                                      "the process likely died — check its logs") from None
            if want and frame is None:
                frame = self._read_frame()
            if not out and (frame is not None or not want):
                return frame
            remaining = deadline - time.monotonic()
            events = (select.POLLOUT if out else 0) | (select.POLLIN if want and frame is None else 0)
            self._poll.modify(self.sock, events)
            if remaining <= 0 or not self._poll.poll(max(1, int(remaining * 1000 + 0.999))):
                if time.monotonic() >= deadline:
                    raise self._fault("did not answer in time; it is stalled, dead, or waiting on "
                                      "a rank that is — raise the timeout only if that rank is "
                                      "legitimately slow")

    def _read_frame(self) -> Frame | None:
        """Consume what the socket has; return a complete frame, or None if it needs more bytes."""
        while True:
            if self._header is None:
                if len(self._buf) >= _PREFIX.size:
                    (header_len,) = _PREFIX.unpack_from(self._buf)
                    if header_len > MAX_HEADER_BYTES:
                        raise self._fault(f"sent a {header_len}-byte frame header (limit "
                                          f"{MAX_HEADER_BYTES}); it is not speaking this protocol")
                    end = _PREFIX.size + header_len
                    if len(self._buf) >= end:
                        header = bytes(self._buf[_PREFIX.size:end])
                        del self._buf[:end]
                        self._start_payload(header)
                        continue
                if not self._recv_into_buffer():
                    return None
            elif self._filled < len(self._payload):
                # Payload bytes go straight to their final buffer: no over-read, no extra copy.
                try:
                    n = self.sock.recv_into(memoryview(self._payload)[self._filled:])
                except BlockingIOError:
                    return None
                except OSError as e:
                    raise self._fault(f"dropped the connection ({e}); the process likely died") from None
                if n == 0:
                    raise self._fault("closed the connection mid-frame; the process likely died")
                self._filled += n
            else:
                op, seq, dtype, shape, _ = self._header
                frame = Frame(op, seq, dtype, shape, self._payload)
                self._header, self._payload, self._filled = None, bytearray(), 0
                return frame

    def _start_payload(self, header: bytes) -> None:
        try:
            self._header = _decode_header(header)
        except ValueError as e:
            raise self._fault(f"sent a malformed frame header: {e}; is it running the same "
                              "rackserve version?") from None
        nbytes = self._header[4]
        if nbytes > self.max_frame_bytes:
            raise self._fault(f"announced a {nbytes}-byte frame, over max_frame_bytes="
                              f"{self.max_frame_bytes}; raise max_frame_bytes on every member if "
                              "such payloads are intended")
        self._payload = bytearray(nbytes)
        self._filled = min(nbytes, len(self._buf))
        self._payload[:self._filled] = self._buf[:self._filled]
        del self._buf[:self._filled]

    def _recv_into_buffer(self) -> bool:
        """Append whatever the socket has to the header buffer; False if it has nothing yet."""
        try:
            chunk = self.sock.recv(_RECV_CHUNK)
        except BlockingIOError:
            return False
        except OSError as e:
            raise self._fault(f"dropped the connection ({e}); the process likely died") from None
        if not chunk:
            raise self._fault("closed the connection; the process likely died or closed its "
                              "communicator early")
        self._buf += chunk
        return True


def listen(host: str = "127.0.0.1", port: int = 0, backlog: int = 128) -> socket.socket:
    """A bound, listening TCP socket; ``port=0`` lets the OS pick a free port."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def dial(host: str, port: int, deadline: float) -> socket.socket:
    """Connect to (host, port), retrying while nobody listens there yet, until ``deadline``;
    then re-raise the last OSError."""
    while True:
        try:
            return socket.create_connection((host, port), timeout=max(0.01, deadline - time.monotonic()))
        except OSError:
            if time.monotonic() + 0.05 >= deadline:
                raise
            time.sleep(0.05)


def _views(header: bytes, payload) -> list[memoryview]:
    views = [memoryview(header)]
    payload = memoryview(payload).cast("B")
    if len(payload):
        views.append(payload)
    return views
