"""`InstanceClient`: the request side of one instance, usable from any process that has its handles.

The instance's owner (`Instance`, whose `GangSupervisor` starts, restarts and stops the gang) holds one for its own
Python API; every ingress replica holds one per instance, built from handles the owner hands out.
A client submits to a DP rank (waking the rest of the gang so that it steps too), streams the
outputs of its own requests from its own output pump per DP rank, and aborts them. Each client is a
separate *consumer* of the ranks' outputs (`DPRank.poll_all`), so many clients share a gang without
seeing each other's requests, and outputs go straight from the rank to the process that streams
them.

Routing: a request goes to the DP rank streaming the fewest of this client's requests, unless the
caller names one.

Outputs: a pump thread per DP rank this client has submitted to long-polls the rank for the outputs
of all of this client's requests there and puts each request's into its `OutputStream`, which
`stream` and `astream` read; so a rank answers one poll per client at a time however many requests
it runs.

Faults: a poll that finds the gang failed ends the streams of that gang's requests on the rank with
the owner's reason (`GangOwner.gang_failure`) at once — their callers may go on elsewhere (a deployment replays
them) — and then asks the owner (`GangOwner.gang_failed`) to restart it (once, however many clients
find it) and takes the fresh gang's handles (`GangOwner.members_of`); a call that finds it failed
does the same and is retried on the fresh gang (`faults.retry_after_restart`). Until then the
client is not `serving`.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Protocol

import ray

from rackserve.cluster.faults import GANG_ERRORS, InstanceError, retry_after_restart
from rackserve.cluster.output_stream import OutputStream
from rackserve.engine import RequestOutput, SamplingParams
from rackserve.messages import Submit
from rackserve.timeouts import TIMEOUTS
from rackserve.transfer.transport import KVReservation, StoreHit


class GangOwner(Protocol):
    """What a client needs from whoever owns the gangs (an `Instance`, or the serving data plane)."""

    def members_of(self, name: str) -> tuple[int, list]:
        """The current gang of instance `name`: (generation, member handles)."""

    def gang_failed(self, name: str, generation: int, why: str) -> str:
        """Gang `generation` of `name` failed (a client saw `why`): restart it if it is still the current
        one; why it failed, for the requests it lost."""

    def gang_failure(self, name: str, generation: int, why: str) -> str:
        """Why gang `generation` of `name` failed (diagnosed once, before any restart), restarting nothing."""


class InstanceClient:
    def __init__(self, name: str, dep: int, owner: GangOwner, shape: str = "", consumer: str | None = None):
        """The request side of instance `name` (`dep` DP ranks, members `0 … dep-1` of its gang) whose
        gangs `owner` keeps; `consumer`: this client's name at the ranks (default: a fresh one)."""
        self.name, self.dep, self.shape, self._owner = name, dep, shape or f"instance {name!r}", owner
        self.consumer = consumer or f"{name}-{secrets.token_hex(6)}"
        self._lock = threading.Lock()  # the view (generation, members) and the pumps running
        self.generation, self.members = owner.members_of(name)
        self.failed = -1  # the latest gang generation found failed
        self._pumps: set[tuple[int, int]] = set()  # (generation, DP rank) with a pump running
        self._streams: dict[str, OutputStream] = {}  # request id -> its outputs' stream (DP rank, gang generation)
        self._streams_lock = threading.Lock()  # held only to read or change `_streams`, never across a call
        self._closed = False

    # ---- the gang ------------------------------------------------------------------------------------
    @property
    def serving(self) -> bool:
        """False from finding its gang failed until taking a fresh one."""
        return self.failed < self.generation

    def _failed(self, generation: int, cause: BaseException | str) -> str:
        """Gang `generation` failed under us: the owner restarts it (if nobody has yet) and says why;
        then take the fresh gang's handles (the owner's latest, even when its restart failed: the next
        call then finds that one failed, and has it started again)."""
        self.failed = max(self.failed, generation)
        try:
            return self._owner.gang_failed(self.name, generation, cause if isinstance(cause, str) else
                                           f"{type(cause).__name__}: {cause}")
        finally:
            self.refresh()

    def refresh(self) -> None:
        """Take the owner's current gang (after a restart, whoever made it)."""
        generation, members = self._owner.members_of(self.name)
        with self._lock:
            if generation > self.generation:
                self.generation, self.members = generation, members

    # ---- requests ------------------------------------------------------------------------------------
    def submit(self, prompt: list[int], params: SamplingParams | None = None, request_id: str | None = None,
               rank: int | None = None, push_to: KVReservation | None = None,
               cached: StoreHit | None = None, resumed: dict[int, list[int]] | None = None) -> str:
        """Queue a request of prompt token ids on DP rank `rank` (default: the one streaming the fewest of
        ours); returns its id. A gang found dead here is restarted first, so the request is served.
        `push_to`/`cached`/`resumed`: see `Submit` (disaggregated prefill, a replay)."""
        req = Submit(request_id or f"{self.consumer}-{secrets.token_hex(4)}", list(prompt),
                     params or SamplingParams(), push_to, cached, resumed)
        self._on_rank(rank, req, "submit", own=push_to is None)  # a pushed request streams from its decode rank
        return req.request_id

    def reserve(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
                rank: int | None = None, resumed: dict[int, list[int]] | None = None
                ) -> tuple[str, KVReservation | None]:
        """Decode side of P/D: (request id, a reservation for the prefill rank to push to, or None when the
        rank's pool is full and it prefills the request itself). Stream it as usual."""
        req = Submit(request_id or f"{self.consumer}-{secrets.token_hex(4)}", list(prompt), params, resumed=resumed)
        return req.request_id, self._on_rank(rank, req, "reserve")

    def _on_rank(self, rank: int | None, req: Submit, method: str, own: bool = True):
        """Call `method(req)` on DP rank `rank` (default: the least loaded), waking the whole gang; `own`:
        stream the request from here (it counts in the rank's load). The lock is held only to choose: the
        call waits for the rank's next step boundary (a reservation), and concurrent submits must reach
        the rank in the same step, not one per step."""
        request_id = req.request_id
        if own:
            req = replace(req, consumer=self.consumer)

        def choose() -> tuple[int, tuple[list, int]]:
            with self._lock:
                generation, members = self.generation, self.members
                at = self._least_loaded() if rank is None else rank
                if own:  # counted before the call, so that concurrent submits spread over the ranks
                    with self._streams_lock:
                        self._streams[request_id] = OutputStream(at, generation)
                    self._start_pump(generation, at)
            return generation, (members, at)

        def call(chosen: tuple[list, int]):
            members, at = chosen
            target = members[at]
            try:  # every member must resume stepping with it
                result, *_ = ray.get([getattr(target, method).remote(req)] +
                                     [m.wake.remote() for m in members if m is not target])
            except GANG_ERRORS as e:
                self._forget(request_id)
                if isinstance(getattr(e, "cause", None), ValueError):
                    raise e.cause from None  # the rank refused this request (e.g. too long): not the gang's fault
                raise
            return result

        return retry_after_restart(choose, call, self._failed)

    def _least_loaded(self) -> int:
        """The DP rank streaming the fewest of this client's requests of the current gang (under `_lock`)."""
        loads = [0] * self.dep
        with self._streams_lock:
            for stream in self._streams.values():
                loads[stream.rank] += stream.generation == self.generation
        return loads.index(min(loads))

    def stream(self, request_id: str) -> Iterator[RequestOutput]:
        """The request's outputs as they come; raises `InstanceError` if the gang fails under it."""
        try:
            yield from self._stream_of(request_id).outputs()
        finally:
            self._forget(request_id)

    async def astream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """`stream` for asyncio callers (an HTTP server): awaits outputs without blocking the event loop."""
        try:
            async for out in self._stream_of(request_id).aoutputs():
                yield out
        finally:
            self._forget(request_id)

    def _stream_of(self, request_id: str) -> OutputStream:
        with self._streams_lock:
            return self._streams[request_id]

    def _forget(self, request_id: str) -> OutputStream | None:
        with self._streams_lock:
            return self._streams.pop(request_id, None)

    def abort(self, request_id: str, rank: int | None = None) -> None:
        """Stop a request and free its state (a request of a failed gang is already gone). `rank`:
        where a request not streamed from here runs (a pushed prefill)."""
        stream = self._forget(request_id)
        with self._lock:
            rank, generation = ((stream.rank, stream.generation) if stream is not None
                                else (rank, self.generation if rank is not None else None))
            members = self.members if generation == self.generation else None
        if members is not None:
            try:
                ray.get(members[rank].abort.remote(request_id))
            except ray.exceptions.RayActorError:
                pass

    # ---- outputs ----------------------------------------------------------------------------------------
    def _start_pump(self, generation: int, rank: int) -> None:
        """A pump for DP rank `rank` of gang `generation`, unless one runs (call under `_lock`)."""
        if (generation, rank) not in self._pumps:
            self._pumps.add((generation, rank))
            threading.Thread(target=self._pump, args=(generation, rank, self.members[rank]), daemon=True,
                             name=f"{self.consumer}-g{generation}-pump{rank}").start()

    def _pump(self, generation: int, rank: int, member) -> None:
        """The output pump of DP rank `rank` of gang `generation`: long-polls the rank for this
        client's outputs and puts each request's into its stream, until the gang fails (it then ends
        the streams of the rank's requests with the owner's reason, then has it restarted), the client has
        no request left there (a rank is polled only by the clients with requests on it), or the
        client closes."""
        while not self._closed:
            try:
                ready = ray.get(member.poll_all.remote(TIMEOUTS.output_poll_s, self.consumer))
            except ray.exceptions.RayError as e:  # the rank or its gang failed, or it was shut down
                if not self._closed:
                    self.failed = max(self.failed, generation)
                    try:
                        why = self._owner.gang_failure(self.name, generation, f"{type(e).__name__}: {e}")
                    except Exception:  # noqa: BLE001 - the owner away: the readers must not wait for it
                        why = f"{self.shape} failed ({type(e).__name__}: {e})"
                    # first: a restart may take long (a lost node: the group re-planned, the model loaded)
                    self.end_streams(generation, rank, f"{why}. The instance restarts its gang; resubmit the request")
                    try:
                        self._failed(generation, e)
                    except Exception:  # noqa: BLE001 - not started (no room?): a call or the owner tries again
                        pass
                break
            with self._streams_lock:
                for request_id, outs in ready.items():
                    stream = self._streams.get(request_id)
                    if stream is not None and stream.generation == generation:
                        stream.put(outs)
            # under `_lock`, as `_on_rank` registers a stream and starts a pump: none is missed
            with self._lock, self._streams_lock:
                if not any(s.generation == generation and s.rank == rank for s in self._streams.values()):
                    self._pumps.discard((generation, rank))
                    return
        with self._lock:
            self._pumps.discard((generation, rank))

    def end_streams(self, generation: int, rank: int | None, why: str) -> None:
        """End the streams of gang `generation`'s requests on DP rank `rank` (None: every rank) with
        an `InstanceError` saying `why`."""
        with self._streams_lock:
            for request_id, stream in self._streams.items():
                if stream.generation == generation and rank in (None, stream.rank):
                    stream.put([InstanceError(f"request {request_id} was lost: {why}")])

    def close(self, why: str | None = None) -> None:
        """Stop the pumps (within a poll); with `why`, end every open stream with it."""
        self._closed = True
        if why is not None:
            self.end_streams(self.generation, None, why)
