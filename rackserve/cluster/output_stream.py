"""`OutputStream`: one request's outputs handed from a thread to a blocking or an asyncio reader.

The writer is an output pump (a thread of `InstanceClient`, long-polling a DP rank); the reader
iterates `outputs()` in a thread, or `aoutputs()` in an event loop (an HTTP server), which the
writer wakes with `call_soon_threadsafe` so that a waiting reader holds no thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator

from rackserve.cluster.faults import InstanceError
from rackserve.engine import RequestOutput


class OutputStream:
    """The outputs of a request on DP rank `rank` of gang `generation`, in order; the stream ends with
    a finished output, or with an `InstanceError` (the gang failed, or the client closed)."""

    def __init__(self, rank: int, generation: int):
        self.rank, self.generation = rank, generation
        self._items: list[RequestOutput | InstanceError] = []  # not taken yet; an error only last
        self._ready = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None  # an asyncio reader's, from its first take
        self._event: asyncio.Event | None = None

    def put(self, items: list[RequestOutput | InstanceError]) -> None:
        with self._ready:
            self._items += items
            self._ready.notify()
            loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._event.set)
            except RuntimeError:  # the reader's event loop is closed: nobody waits
                pass

    def outputs(self) -> Iterator[RequestOutput]:
        """Every output as it comes, blocking; raises the `InstanceError` that ended the stream."""
        while True:
            outs = self._take()
            yield from outs
            if outs[-1].finished:
                return

    async def aoutputs(self) -> AsyncIterator[RequestOutput]:
        """`outputs` for an asyncio reader: awaits instead of blocking its event loop."""
        while True:
            outs = await self._atake()
            for out in outs:
                yield out
            if outs[-1].finished:
                return

    def _take(self) -> list[RequestOutput]:
        """The outputs put since the last take (waits for one)."""
        with self._ready:
            self._ready.wait_for(lambda: self._items)
            return self._pop()

    async def _atake(self) -> list[RequestOutput]:
        with self._ready:
            if self._loop is None:
                self._loop, self._event = asyncio.get_running_loop(), asyncio.Event()
        while True:
            with self._ready:
                if self._items:
                    self._event.clear()  # sets still queued are for the items taken here
                    return self._pop()
            await self._event.wait()

    def _pop(self) -> list[RequestOutput]:
        """The outputs before the first error (the error stays, for the next take), or that error."""
        end = next((i for i, item in enumerate(self._items) if isinstance(item, InstanceError)), len(self._items))
        if end == 0:
            raise self._items[0]
        outs, self._items = self._items[:end], self._items[end:]
        return outs
