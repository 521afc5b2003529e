"""A group of processes that all-reduce, all-gather, broadcast and barrier over persistent TCP.

Latency-optimal for the small arrays of the per-step sync: all-reduce takes log2(P) pairwise
exchange rounds (+2 fold steps when P is not a power of two), where a ring takes 2(P-1) hops.
Every round sends the whole array, so this is *not* bandwidth-optimal for large arrays.

Setup (in the constructor): lower rank connects to higher rank, only along the edges the
schedule uses (at most log2(P)+1 per member), each connection proves the group secret both ways.
A member listens on its peer-table entry, or on a pre-bound socket passed as ``listener`` (what
``rendezvous.rendezvous`` returns); the listener is closed as soon as every expected peer is in,
so afterwards nothing can connect at all.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence

import msgpack
import numpy as np

from rackserve.collective import codec, handshake
from rackserve.collective.acceptor import Acceptor
from rackserve.collective.errors import CollectiveError
from rackserve.collective.schedule import broadcast_steps, doubling_steps, neighbours
from rackserve.collective.wire import DEFAULT_MAX_FRAME_BYTES, Connection, Frame, dial, encode_header, listen

_REDUCE = {"sum": np.add, "max": np.maximum, "min": np.minimum}
_DTYPES = tuple(np.dtype(t) for t in (np.int32, np.int64, np.float32, np.float64))
# Each later stage of a call waits timeout * this much longer, so the member next to a stalled
# rank times out first and everyone gets its diagnosis rather than blaming a waiting neighbour.
_STAGE_SLACK = 0.05
_ABORT = "abort"


def _describe(dtype: str, shape: tuple[int, ...]) -> str:
    try:
        dtype = np.dtype(dtype).name
    except TypeError:
        pass
    return f"{dtype}{list(shape)}"


class _Relayed(CollectiveError):
    """An abort notice from a peer: someone else already diagnosed the failure."""

    def __init__(self, reason: str, ranks: tuple[int, ...]):
        super().__init__(reason, ranks)
        self.reason = reason


class Communicator:
    """One member of a collective group of ``world_size`` processes.

    Args:
        rank: this member, 0 <= rank < world_size.
        world_size: number of members P (any P >= 1).
        peers: the peer table, ``peers[r] = (host, port)`` where rank r listens.
        secret: the group secret (bytes or str), the same on every member.
        timeout: seconds one call may take before the rank it waits on is declared dead or
            stalled; later steps of a call get up to ``timeout * 0.05 * (log2 P + 1)`` more.
        listener: a bound, listening socket for ``peers[rank]`` (the communicator takes it
            over); None binds ``peers[rank]`` itself.
        connect_timeout: seconds to wait for every peer to connect; default max(timeout, 30).
        max_frame_bytes: largest payload accepted from a peer; bigger frames are refused.

    Not thread-safe: drive one communicator from one thread. Every member must make the same
    calls in the same order. After a CollectiveError the communicator is unusable.
    """

    def __init__(self, rank: int, world_size: int, peers: Sequence[tuple[str, int]],
                 secret: bytes | str, timeout: float = 30.0, *,
                 listener: socket.socket | None = None, connect_timeout: float | None = None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}; need 0 <= rank < world_size")
        if len(peers) != world_size:
            raise ValueError(f"peer table has {len(peers)} entries for a world of {world_size}; "
                             "it needs one (host, port) per rank")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.rank, self.world_size, self.timeout = rank, world_size, float(timeout)
        self._key = handshake.secret_bytes(secret)
        self._peers = [(str(host), int(port)) for host, port in peers]
        self._max_frame_bytes = max_frame_bytes
        self._doubling = doubling_steps(rank, world_size)
        self._conns: dict[int, Connection] = {}
        self._seq = 0
        self._failure: CollectiveError | None = None
        self._closed = False
        self._acceptor: Acceptor | None = None
        self._setup(listener, max(self.timeout, 30.0) if connect_timeout is None else connect_timeout)

    # ------------------------------------------------------------------ setup

    def _setup(self, listener: socket.socket | None, connect_timeout: float) -> None:
        deadline = time.monotonic() + connect_timeout
        linked = neighbours(self.rank, self.world_size)
        inbound = {p for p in linked if p < self.rank}
        if inbound:
            if listener is None:
                host, port = self._peers[self.rank]
                try:
                    listener = listen(host, port)
                except OSError as e:
                    raise CollectiveError(f"rank {self.rank} cannot listen on {host}:{port} ({e}); "
                                          "fix its peer-table entry, or pass a bound listener=") from None
            self._acceptor = Acceptor(listener, self._key, self.rank, self.world_size, inbound,
                                      deadline, self.timeout, self._max_frame_bytes)
        elif listener is not None:
            listener.close()  # rank 0 and some extras: nobody connects to us
        try:
            for peer in sorted(p for p in linked if p > self.rank):
                self._conns[peer] = self._dial(peer, deadline)
            if self._acceptor:
                self._conns.update(self._acceptor.wait())
        except BaseException:
            self.close()
            raise
        finally:
            if self._acceptor:
                self._acceptor.stop()

    def _dial(self, peer: int, deadline: float) -> Connection:
        host, port = self._peers[peer]
        try:
            sock = dial(host, port, deadline)
        except OSError as e:
            raise CollectiveError(f"rank {self.rank} could not connect to rank {peer} at "
                                  f"{host}:{port} ({e}); is it running, and do all members have "
                                  "the same peer table?", ranks=(peer,)) from None
        conn = Connection(sock, peer)
        try:
            handshake.connect(conn, self._key, self.world_size, self.rank, peer, deadline,
                              self._max_frame_bytes)
        except BaseException:
            conn.close()
            raise
        return conn

    @property
    def refused_connections(self) -> int:
        """Strangers refused during setup (wrong secret, garbage, unexpected rank, stalling)."""
        return self._acceptor.refused if self._acceptor else 0

    # ------------------------------------------------------------- collectives

    def allreduce(self, array: np.ndarray, op: str = "sum") -> np.ndarray:
        """Element-wise reduction over all members; returns a new array (same shape, dtype).

        ``array``: int32 / int64 / float32 / float64, any shape, the same on every member.
        ``op``: "sum", "max" or "min". Every member gets a bit-identical result: partials are
        always combined lower-rank block first, in the same tree on every member.
        """
        arr = np.asarray(array)
        if arr.dtype not in _DTYPES:
            raise TypeError(f"allreduce supports int32, int64, float32 and float64 arrays in "
                            f"native byte order, got {arr.dtype.str}; cast with "
                            "arr.astype(np.float32) or similar")
        if op not in _REDUCE:
            raise ValueError(f"allreduce op must be one of {sorted(_REDUCE)}, got {op!r}")
        return self._allreduce(np.array(arr, order="C", copy=True), op, f"allreduce.{op}")

    def barrier(self) -> None:
        """Return once every member has entered the barrier (an all-reduce of an empty array)."""
        self._allreduce(np.zeros(0, np.int32), "sum", "barrier")

    def allgather(self, value) -> list:
        """Every member's ``value``, in rank order, on every member.

        ``value``: a numeric numpy array or anything msgpack can carry (see ``codec``); tuples
        come back as lists. Sizes may differ between members.
        """
        blocks = {self.rank: codec.pack(value)}
        seq, start = self._begin()
        try:
            for step in self._doubling:
                deadline = self._deadline(start, step.stage)
                conn = self._conns[step.peer]
                if step.kind == "send":
                    conn.send(*self._frame("allgather", seq, blocks), deadline)
                    continue
                frame = (conn.recv(deadline) if step.kind in ("recv", "result")
                         else conn.exchange(*self._frame("allgather", seq, blocks), deadline))
                theirs = self._blocks(frame, step.peer, "allgather", seq)
                if step.kind == "result":
                    blocks = theirs
                elif theirs.keys() & blocks.keys():
                    raise CollectiveError(f"rank {step.peer} sent all-gather blocks we already "
                                          "hold; the group's schedules disagree", (step.peer,))
                else:
                    blocks.update(theirs)
            if len(blocks) != self.world_size:
                raise CollectiveError(f"all-gather ended with {len(blocks)} of {self.world_size} "
                                      "blocks; the group's schedules disagree")
            values = []
            for r in range(self.world_size):
                try:
                    values.append(codec.unpack(blocks[r]))
                except Exception as e:
                    raise CollectiveError(f"rank {r}'s all-gather value is undecodable ({e})", (r,)) from None
            return values
        except CollectiveError as e:
            raise self._fail(e, "allgather", seq) from None

    def broadcast(self, value=None, root: int = 0):
        """``root``'s ``value`` on every member (``value`` is ignored elsewhere).

        Same value types as ``allgather``; the root gets the decoded copy too, so every member
        sees the same thing (e.g. lists where the root passed tuples).
        """
        steps = broadcast_steps(self.rank, root, self.world_size)
        blob = codec.pack(value) if self.rank == root else b""
        op = f"broadcast.{root}"
        seq, start = self._begin()
        try:
            for step in steps:
                deadline = self._deadline(start, step.stage)
                conn = self._conns[step.peer]
                if step.kind == "send":
                    conn.send(encode_header(op, seq, "", (), len(blob)), blob, deadline)
                else:
                    frame = conn.recv(deadline)
                    self._check(frame, step.peer, op, seq)
                    blob = frame.payload
            try:
                return codec.unpack(blob)
            except Exception as e:
                raise CollectiveError(f"rank {root}'s broadcast value is undecodable ({e})",
                                      (root,)) from None
        except CollectiveError as e:
            raise self._fail(e, op, seq) from None

    def _allreduce(self, acc: np.ndarray, op: str, name: str) -> np.ndarray:
        reduce = _REDUCE[op]
        seq, start = self._begin()
        header = encode_header(name, seq, acc.dtype.str, acc.shape, acc.nbytes)
        try:
            for step in self._doubling:
                deadline = self._deadline(start, step.stage)
                conn = self._conns[step.peer]
                if step.kind == "send":
                    conn.send(header, _raw(acc), deadline)
                    continue
                frame = (conn.recv(deadline) if step.kind in ("recv", "result")
                         else conn.exchange(header, _raw(acc), deadline))
                theirs = self._array(frame, step.peer, name, seq, acc)
                if step.kind != "result":
                    # Lower rank's partial first: both partners then compute the same bits.
                    lower, higher = (acc, theirs) if self.rank < step.peer else (theirs, acc)
                    reduce(lower, higher, out=theirs)
                acc = theirs
            return acc
        except CollectiveError as e:
            raise self._fail(e, name, seq) from None

    # ---------------------------------------------------------------- helpers

    def _begin(self) -> tuple[int, float]:
        if self._closed:
            raise CollectiveError(f"rank {self.rank}: the communicator is closed")
        if self._failure is not None:
            raise CollectiveError(f"rank {self.rank}: this communicator failed earlier and cannot "
                                  f"be reused; build a new group. Earlier failure: {self._failure}",
                                  self._failure.ranks)
        self._seq += 1
        return self._seq, time.monotonic()

    def _deadline(self, start: float, stage: int) -> float:
        return start + self.timeout * (1 + _STAGE_SLACK * stage)

    def _check(self, frame: Frame, peer: int, op: str, seq: int) -> None:
        if frame.op == _ABORT:
            try:
                ranks, reason = msgpack.unpackb(frame.payload, raw=False)
                ranks = tuple(int(r) for r in ranks)
            except Exception:
                ranks, reason = (peer,), f"rank {peer} aborted the call"
            raise _Relayed(str(reason), ranks)
        if (frame.op, frame.seq) != (op, seq):
            raise CollectiveError(
                f"rank {peer} sent {frame.op} #{frame.seq} while rank {self.rank} expected "
                f"{op} #{seq}: every member must make the same collective calls in the same order",
                ranks=tuple(sorted((peer, self.rank))))  # which of the two is wrong is unknowable

    def _array(self, frame: Frame, peer: int, op: str, seq: int, like: np.ndarray) -> np.ndarray:
        self._check(frame, peer, op, seq)
        if (frame.dtype, frame.shape, len(frame.payload)) != (like.dtype.str, like.shape, like.nbytes):
            raise CollectiveError(
                f"rank {peer} sent {_describe(frame.dtype, frame.shape)} to {op} #{seq} while rank "
                f"{self.rank} has {_describe(like.dtype.str, like.shape)}: every member must pass "
                "the same shape and dtype", ranks=tuple(sorted((peer, self.rank))))
        return np.frombuffer(frame.payload, dtype=like.dtype).reshape(like.shape)

    def _frame(self, op: str, seq: int, blocks: dict[int, bytes]) -> tuple[bytes, bytes]:
        payload = msgpack.packb(list(blocks.items()), use_bin_type=True)
        return encode_header(op, seq, "", (), len(payload)), payload

    def _blocks(self, frame: Frame, peer: int, op: str, seq: int) -> dict[int, bytes]:
        self._check(frame, peer, op, seq)
        try:
            pairs = msgpack.unpackb(frame.payload, raw=False)
            blocks = {r: b for r, b in pairs if type(r) is int and 0 <= r < self.world_size
                      and isinstance(b, bytes)}
            if len(blocks) != len(pairs):
                raise ValueError("bad rank or block")
        except Exception as e:
            raise CollectiveError(f"rank {peer} sent a malformed all-gather payload ({e})", (peer,)) from None
        return blocks

    def _fail(self, error: CollectiveError, op: str, seq: int) -> CollectiveError:
        """Record the failure, tell every neighbour (so nobody waits out its timeout on us),
        and return the error to raise."""
        if isinstance(error, _Relayed):
            reason = error.reason  # already says which rank saw it first
            message = f"rank {self.rank}: {op} #{seq} failed: {reason}"
        else:
            reason = f"{error} (seen by rank {self.rank})"
            message = f"rank {self.rank}: {op} #{seq} failed: {error}"
        self._failure = CollectiveError(message, error.ranks)
        notice = msgpack.packb([list(error.ranks), reason])
        header = encode_header(_ABORT, seq, "", (), len(notice))
        for conn in self._conns.values():
            conn.send_nowait(header, notice)
        return self._failure

    # -------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Close every connection; idempotent. Peers still in a call will see us leave."""
        self._closed = True
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _raw(arr: np.ndarray) -> memoryview:
    return memoryview(arr.reshape(-1).view(np.uint8))
