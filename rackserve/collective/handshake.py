"""Mutual proof of the group secret on a fresh connection (HMAC-SHA256 challenge-response).

    acceptor  -> connector : challenge [version, world, acceptor id, nonce_a]
    connector -> acceptor  : response  [connector id, nonce_c, HMAC(secret, "connect" | transcript)]
    acceptor  -> connector : accept    [HMAC(secret, "accept" | transcript)]

The transcript binds both fresh nonces, both ids and the world size, so a recorded exchange
cannot be replayed and one direction's proof cannot be reflected as the other's. Comparisons use
``hmac.compare_digest``. This authenticates members; it does not encrypt or sign later frames,
so run the group on a network you trust against active tampering.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable

import msgpack

from rackserve.collective.errors import CollectiveError
from rackserve.collective.wire import Connection, encode_header

PROTOCOL = "rackserve-collective/1"
COORDINATOR = -1  # the id the rendezvous coordinator uses in handshakes
_HANDSHAKE_MAX_BYTES = 512  # every handshake payload is ~100 bytes; a stranger gets no more
_NONCE_BYTES = 32


def secret_bytes(secret: bytes | str) -> bytes:
    """Normalise a group secret; reject an empty one with the fix in the message."""
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not key:
        raise ValueError("the group secret is empty; generate one with secrets.token_hex(32) "
                         "and give the same value to every member")
    return key


def _mac(key: bytes, direction: bytes, world: int, connector: int, acceptor: int,
         nonce_a: bytes, nonce_c: bytes) -> bytes:
    transcript = msgpack.packb([PROTOCOL, world, connector, acceptor, nonce_a, nonce_c])
    return hmac.new(key, direction + transcript, hashlib.sha256).digest()


def _send(conn: Connection, op: str, fields: list, deadline: float) -> None:
    payload = msgpack.packb(fields)
    conn.send(encode_header(op, 0, "", (), len(payload)), payload, deadline)


def _recv(conn: Connection, op: str, deadline: float) -> list:
    frame = conn.recv(deadline)
    if frame.op != op:
        raise CollectiveError(f"{conn.name} sent {frame.op!r} during the handshake, expected {op!r}")
    try:
        fields = msgpack.unpackb(bytes(frame.payload), raw=False)
    except Exception:
        fields = None
    if not isinstance(fields, list):
        raise CollectiveError(f"{conn.name} sent an undecodable {op!r} during the handshake")
    return fields


def accept(conn: Connection, key: bytes, world: int, my_id: int,
           claim: Callable[[int], bool], deadline: float, max_frame_bytes: int) -> int:
    """Acceptor side. Returns the connector's proven id; raises CollectiveError on any failure
    (the caller closes the socket). ``claim(id)`` reserves that id for this connection and says
    whether it may connect here at all (False: unexpected, or already connected)."""
    conn.max_frame_bytes = _HANDSHAKE_MAX_BYTES
    nonce_a = os.urandom(_NONCE_BYTES)
    _send(conn, "challenge", [PROTOCOL, world, my_id, nonce_a], deadline)
    fields = _recv(conn, "response", deadline)
    if not (len(fields) == 3 and type(fields[0]) is int and isinstance(fields[1], bytes)
            and isinstance(fields[2], bytes)):
        raise CollectiveError("handshake response has the wrong shape")
    peer, nonce_c, proof = fields
    expected = _mac(key, b"connect", world, peer, my_id, nonce_a, nonce_c)
    if not hmac.compare_digest(proof, expected):
        raise CollectiveError(f"a connection claiming to be rank {peer} failed the secret check")
    if not claim(peer):
        raise CollectiveError(f"rank {peer} is not expected to connect to {my_id} (or already did)")
    conn.peer = peer
    _send(conn, "accept", [_mac(key, b"accept", world, peer, my_id, nonce_a, nonce_c)], deadline)
    conn.max_frame_bytes = max_frame_bytes
    return peer


def connect(conn: Connection, key: bytes, world: int, my_id: int, their_id: int,
            deadline: float, max_frame_bytes: int) -> None:
    """Connector side: prove the secret to ``their_id`` and check its proof back."""
    conn.max_frame_bytes = _HANDSHAKE_MAX_BYTES
    try:
        protocol, their_world, acceptor, nonce_a = _recv(conn, "challenge", deadline)
    except ValueError:
        raise CollectiveError(f"{conn.name} sent a malformed handshake challenge") from None
    if (protocol, their_world, acceptor) != (PROTOCOL, world, their_id):
        raise CollectiveError(
            f"the member listening at {conn.name}'s address is {acceptor} of a world of "
            f"{their_world} speaking {protocol!r}; we expected {their_id} of {world} speaking "
            f"{PROTOCOL!r} — every member must get the same peer table and rackserve version",
            ranks=(their_id,) if their_id >= 0 else ())
    nonce_c = os.urandom(_NONCE_BYTES)
    _send(conn, "response", [my_id, nonce_c, _mac(key, b"connect", world, my_id, their_id,
                                                  nonce_a, nonce_c)], deadline)
    try:
        (proof,) = _recv(conn, "accept", deadline)
    except CollectiveError as e:
        raise CollectiveError(f"{e} — it rejected our proof of the group secret: every member "
                              "must use the same secret", e.ranks) from None
    except ValueError:
        raise CollectiveError(f"{conn.name} sent a malformed handshake accept") from None
    expected = _mac(key, b"accept", world, my_id, their_id, nonce_a, nonce_c)
    if not (isinstance(proof, bytes) and hmac.compare_digest(proof, expected)):
        raise CollectiveError(f"{conn.name} could not prove the group secret; it is not a member "
                              "of this group (or uses another secret)",
                              ranks=(their_id,) if their_id >= 0 else ())
    conn.max_frame_bytes = max_frame_bytes
