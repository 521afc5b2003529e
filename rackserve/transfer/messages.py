"""The notifications ranks and KV stores exchange about request state: one dataclass per kind, one
msgpack codec for all of them.

    prefill rank -> decode rank   Pushed      the request's state is in its reservation (rides on the WRITE)
                                  PushFailed  it will not come: prefill it on the decode rank
    writer rank  -> KV store      Put         a prefix's state is in the writer's inbox (rides on the WRITE)
    KV store     -> writer rank   Freed       that inbox range may be reused
    reader rank  -> KV store      Release     the pinned lookup result was read

On the wire a message is the msgpack array `[kind, *fields in declaration order]`. `Message.decode`
checks the kind and every field's type; `receive` decodes what an agent's `notifications()` returned,
logging and dropping what is malformed or unknown, so a bad peer can never stop a poll loop; `send`
logs, never raises, when the peer cannot be reached, as a lost notification costs only a timeout.
"""

from __future__ import annotations

import functools
import logging
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import msgpack

from rackserve.transfer.transport import KVTransport, TransferError

log = logging.getLogger(__name__)


class MessageError(ValueError):
    """Bytes that are not a message of a known kind with fields of the declared types."""


_KINDS: dict[str, type[Message]] = {}


@dataclass(frozen=True)
class Message:
    kind: ClassVar[str]

    def __init_subclass__(cls, kind: str, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.kind = kind
        _KINDS[kind] = cls

    def encode(self) -> bytes:
        return msgpack.packb([self.kind, *(getattr(self, f.name) for f in fields(self))])

    @staticmethod
    def decode(data: bytes) -> Message:
        """The message `data` encodes; `MessageError` naming what is wrong with it."""
        try:
            kind, *values = msgpack.unpackb(data)
        except Exception as e:  # msgpack raises several types; a non-array or empty array fails to unpack
            raise MessageError(f"{bytes(data[:40])!r} is not a msgpack array [kind, *fields] ({e!r})") from e
        cls = _KINDS.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise MessageError(f"unknown kind {kind!r}; known: {sorted(_KINDS)}")
        schema = _schema(cls)
        if len(values) != len(schema):
            raise MessageError(f"{kind!r} has {len(values)} fields, not {len(schema)} ({', '.join(schema)})")
        for value, (name, hint) in zip(values, schema.items()):
            if not _conforms(value, hint):
                raise MessageError(f"{kind!r} field {name}={value!r:.60} is not of type {_name(hint)}")
        return cls(*values)


@dataclass(frozen=True)
class Pushed(Message, kind="pushed"):
    """The state of `request_id` is in its reservation. `token`: the first output token the prefill
    rank sampled, or -1 (a request of several choices: pushed with its prompt but the last token,
    its choices fork and sample on the decode rank); `logprob`, `top_ids`, `top_logprobs`: its
    log-probability and the top alternatives when the request asked for logprobs (None, [], []
    otherwise); `num_cached`: prompt tokens its prefix cache served."""

    request_id: str
    token: int
    logprob: float | None
    top_ids: list[int]
    top_logprobs: list[float]
    num_cached: int


@dataclass(frozen=True)
class PushFailed(Message, kind="push_failed"):
    request_id: str


@dataclass(frozen=True)
class Put(Message, kind="put"):
    """A prefix of `token_ids` (whole blocks) is at `[offset, offset + nbytes)` of the writer's inbox,
    in `PagedState.export_into` layout."""

    offset: int
    nbytes: int
    token_ids: list[int]


@dataclass(frozen=True)
class Freed(Message, kind="freed"):
    offset: int  # of the range in the writer's inbox, as its Put said


@dataclass(frozen=True)
class Release(Message, kind="release"):
    addr: int  # of the lookup result's region (`RemoteRegion.addr`)


def send(agent: KVTransport, peer: str, message: Message) -> None:
    """Notify `peer` of `message` (no data). One that cannot be reached is logged: whatever it was told
    is recovered by a timeout (a reservation expires, a pin's TTL runs out) or concerns nobody any more."""
    try:
        agent.notify(peer, message.encode())
    except TransferError as e:
        log.warning("%s not sent: %s", message, e)


def receive(notifications: list[tuple[str, bytes]]) -> Iterator[tuple[str, Message]]:
    """(peer name, message) for each of an agent's notifications that decodes; the others are logged."""
    for peer, data in notifications:
        try:
            yield peer, Message.decode(data)
        except MessageError as e:
            log.warning("dropped a notification from %r: %s", peer, e)


@functools.cache
def _schema(cls: type[Message]) -> dict[str, Any]:
    """Field name -> type, in declaration order."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def _name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint)  # int, but list[int], float | None


def _conforms(value: object, hint: Any) -> bool:
    """Whether an unpacked msgpack value is a `hint` (str, int, float, None, unions and lists of them)."""
    if isinstance(hint, types.UnionType):
        return any(_conforms(value, h) for h in typing.get_args(hint))
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_conforms(v, item) for v in value)
    if hint is type(None):
        return value is None
    if isinstance(value, bool):  # a bool is an int to isinstance, never to a message
        return hint is bool
    return isinstance(value, hint) or (hint is float and isinstance(value, int))
