"""A rank's side of disaggregated prefill/decode: state pushed over a `KVTransport` (NIXL by default;
DESIGN.md, P/D).

Decode side: `reserve` sets a range of the rank's registered pool aside for a request whose prompt
another rank prefills and answers where to WRITE it (`KVReservation`); `poll` reads the
notifications that say a state arrived (with the first token the prefill sampled), and turns
failed or expired reservations into requests to prefill here instead (slower, never wrong);
`load` copies an arrived state into the request's slot and pages.

Prefill side: `push` exports a prefilled request's state into the pool and starts the WRITE, with a
`Pushed` notification (the first token, its logprobs, prompt tokens served by a prefix cache);
`progress` releases the pool ranges of finished WRITEs, and tells the decode rank at once when one
fails (`PushFailed`). The notifications are `rackserve.transfer.messages`.

With a KV store (`attach_store`, see `prefix_store.py`): `pull` READs a cached prefix of a new
request before it is prefilled (it then waits in `incoming` like a pushed state; a prefix that ends
without a snapshot is replayed from its `resume_at` over the blocks read; a READ not done within
`TIMEOUTS.pull_s`, from a stopped or stalled store, is given up and the prompt prefilled); `put` WRITEs
the longest snapshotted prefix of a request into this rank's inbox at the store.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rackserve.engine.request import Request, RequestOutput, TokenLogprobs
from rackserve.engine.state_cache import CacheHandle, StateCache
from rackserve.timeouts import TIMEOUTS
from rackserve.transfer.messages import Freed, Pushed, PushFailed, Put, Release, receive, send
from rackserve.transfer.pool import RangeAllocator
from rackserve.transfer.transport import (ALIGN, KVReservation, KVTransport, RemoteRegion, StoreHit, Transfer,
                                          TransferError)

if TYPE_CHECKING:
    from rackserve.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass
class KVStats:
    reserved: int = 0  # reservations made (decode)
    loaded: int = 0  # pushed states admitted (decode)
    recomputed: int = 0  # reservations that failed or expired: prefilled locally instead (decode)
    expired: int = 0  # of which: no transfer in time
    pushed: int = 0  # states written to a decode rank (prefill)
    push_failures: int = 0  # pushes that could not start or failed (prefill)
    pulled: int = 0  # cached prefixes read from the KV store
    pulled_tokens: int = 0
    pull_failures: int = 0  # reads that failed: the request is prefilled from scratch
    pulls_local: int = 0  # store hits not read: this rank's own cache held as much
    puts: int = 0  # prefixes written to the KV store
    bytes_in: int = 0
    bytes_out: int = 0


@dataclass
class Incoming:
    """State on its way in: a reservation on the decode side (`first` is set when it has arrived),
    or a READ of a cached prefix (`read` in flight; done when `read` is None)."""

    request: Request
    offset: int
    nbytes: int
    expires_at: float
    first: tuple[int, TokenLogprobs | None, int] | None = None  # token, its logprobs, cached prompt tokens
    read: Transfer | None = None
    num_tokens: int = 0  # tokens of a pulled prefix
    source: RemoteRegion | None = None
    resume_at: int = 0  # where a pulled prefix's prefill goes on (below num_tokens: a rebuild first)

    @property
    def pulled(self) -> bool:
        return self.source is not None

    @property
    def ready(self) -> bool:
        return self.read is None if self.pulled else self.first is not None

    @property
    def state_tokens(self) -> int:
        """Tokens of the state that comes in: the pulled prefix's, or what the prefill rank pushes."""
        return self.num_tokens if self.pulled else self.request.num_pushed


@dataclass
class StoreLink:
    """This rank's way to a KV store: the store agent's name and this rank's inbox there."""

    agent: str
    inbox: RemoteRegion
    ranges: RangeAllocator


@dataclass
class Outgoing:
    transfer: Transfer
    offset: int
    request_id: str  # of a push; "" for a put to the KV store
    peer: str
    store_offset: int = -1  # a put's range in this rank's inbox


class KVPort:
    def __init__(self, agent: KVTransport, cache: StateCache, timeout_s: float, loads_per_step: int = 1):
        """`timeout_s`: how long a reservation waits for its push; `loads_per_step`: the most arrived
        states `admit_arrived` takes in one step."""
        self.agent, self.cache, self.timeout_s, self.loads_per_step = agent, cache, timeout_s, loads_per_step
        self.incoming: dict[str, Incoming] = {}  # in reservation order
        self.outgoing: list[Outgoing] = []
        self._quarantine: deque[tuple[float, int]] = deque()  # (release time, offset): expired or given-up ranges
        self.store: StoreLink | None = None
        self.stats = KVStats()

    def attach_store(self, agent: str, inbox: RemoteRegion) -> None:
        """Use the KV store `agent` (already a peer) through `inbox` (from `PrefixStore.add_writer`)."""
        self.store = StoreLink(agent, inbox, RangeAllocator(inbox.nbytes, ALIGN))

    def in_use(self) -> dict[str, int]:
        """What this port holds now, all 0 when idle: bytes of its transfer pool (ranges being
        written, read or kept out of use a while), transfers and reservations in flight, and bytes of
        its inbox at the KV store (prefixes written, not yet taken in)."""
        inbox = self.store.ranges.size - self.store.ranges.bytes_free if self.store is not None else 0
        return {"kv_pool_bytes_in_use": self.agent.pool.numel() - self.agent.bytes_free,
                "kv_in_flight": len(self.incoming) + len(self.outgoing), "kv_inbox_bytes_in_use": inbox}

    @property
    def pending(self) -> bool:
        """Whether a transfer may still arrive or finish, or the KV store still has to say it took in a
        prefix written to it (`Freed`): the rank must keep polling, or its inbox would stay held while
        it idles."""
        inbox = self.store is not None and self.store.ranges.bytes_free < self.store.ranges.size
        return bool(self.incoming or self.outgoing or inbox)

    # ---- decode side -------------------------------------------------------------------------------
    def reserve(self, req: Request) -> KVReservation | None:
        """A pool range for `req`'s prefilled state; None when the pool is full."""
        nbytes = self.cache.state.blob_nbytes(req.num_pushed)
        offset = self.agent.alloc(nbytes)
        if offset is None:
            return None
        expires_at = time.time() + self.timeout_s
        self.incoming[req.request_id] = Incoming(req, offset, nbytes, expires_at)
        self.stats.reserved += 1
        return KVReservation(req.request_id, self.agent.region(offset, nbytes), expires_at)

    def poll(self) -> list[Request]:
        """Take in notifications; returns the requests whose transfer failed or expired, to be
        prefilled here."""
        now = time.time()
        while self._quarantine and self._quarantine[0][0] <= now:
            self.agent.free(self._quarantine.popleft()[1])
        lost = []
        for peer, message in receive(self.agent.notifications()):
            match message:
                case Freed(offset) if self.store is not None and peer == self.store.agent:
                    self._free_inbox_range(offset)
                case Pushed() | PushFailed():
                    inc = self.incoming.get(message.request_id)
                    if inc is None or inc.first is not None:  # a late answer to a reservation given up
                        continue
                    if isinstance(message, Pushed):
                        inc.first = (message.token, _logprobs(message), message.num_cached)
                    else:
                        lost.append(self.cancel(message.request_id))
                case _:
                    log.warning("ignored %s from %r: a rank expects no such notification from it", message, peer)
        for request_id, inc in list(self.incoming.items()):
            if inc.read is not None:
                try:
                    if self.agent.poll(inc.read):
                        inc.read = None
                        send(self.agent, inc.source.agent, Release(inc.source.addr))
                    elif now > inc.expires_at:  # the store does not serve it: its process stopped or stalled
                        log.warning("gave up reading %s's cached prefix from the KV store %r after %.1f s; "
                                    "prefilling it instead", request_id, inc.source.agent, TIMEOUTS.pull_s)
                        self.agent.cancel(inc.read)
                        # the READ may still land if the store wakes: the range stays out of use a while
                        self._quarantine.append((now + self.timeout_s, inc.offset))
                        send(self.agent, inc.source.agent, Release(inc.source.addr))
                        self.stats.pull_failures += 1
                        del self.incoming[request_id]
                        lost.append(inc.request)
                except TransferError:
                    self.stats.pull_failures += 1
                    self.agent.free(inc.offset)
                    del self.incoming[request_id]
                    lost.append(inc.request)
                continue
            if inc.first is None and now > inc.expires_at:
                self.stats.expired += 1
                lost.append(self.cancel(request_id))
        self.stats.recomputed += len(lost)
        return lost

    def arrived(self) -> list[Incoming]:
        """Incoming states that are here, oldest first."""
        return [inc for inc in self.incoming.values() if inc.ready]

    def load(self, inc: Incoming, handle: CacheHandle) -> None:
        """Copy an arrived state into `handle` (holding pages for its tokens) and release its range."""
        num_tokens = inc.state_tokens
        self.cache.fence()
        self.cache.state.import_from(handle, self.agent.view(inc.offset, inc.nbytes), num_tokens)
        del self.incoming[inc.request.request_id]
        self.agent.free(inc.offset)
        if inc.pulled:
            self.stats.pulled += 1
            self.stats.pulled_tokens += num_tokens
        else:
            self.stats.loaded += 1
        self.stats.bytes_in += inc.nbytes

    def admit_arrived(self, scheduler: Scheduler) -> list[RequestOutput]:
        """One step's intake: queue to prefill here what failed to arrive, then admit to `scheduler` at
        most `loads_per_step` arrived states (while it has room), each emitting its first token."""
        for req in self.poll():
            scheduler.add(req)
        outputs = []
        for inc in self.arrived()[: self.loads_per_step]:
            if len(scheduler.running) >= scheduler.config.max_num_seqs:
                break
            handle = self.cache.allocate()
            if handle is None:
                break
            num_tokens = inc.state_tokens
            if not self.cache.reserve(handle, num_tokens + 1):
                self.cache.free(handle)
                break
            req = inc.request
            self.load(inc, handle)
            if inc.pulled and inc.resume_at < num_tokens:  # blocks without a snapshot: rebuild the slot
                self.cache.rebuild(handle, req.token_ids)
            else:
                self.cache.commit(handle, req.token_ids)  # its full blocks join the local prefix cache
            if inc.pulled:  # a cached prefix: prefill goes on from there
                req.num_cached = handle.num_tokens
                scheduler.admit_loaded(req, handle)
            elif req.fork_at is not None:  # n > 1: pushed before sampling, its choices fork here
                req.num_cached = inc.first[2]
                scheduler.admit_loaded(req, handle)
            else:
                token, logprobs, req.num_cached = inc.first
                outputs.append(scheduler.admit_loaded(req, handle, token, logprobs))
        return outputs

    # ---- KV store ------------------------------------------------------------------------------------
    def pull(self, req: Request, hit: StoreHit) -> bool:
        """Start READing a cached prefix of `req` (`hit`, a KV store's lookup); False if it cannot
        start (the request is then prefilled from scratch)."""
        source, num_tokens = hit.region, hit.num_tokens
        offset = self.agent.alloc(source.nbytes) if source.nbytes == self.cache.state.blob_nbytes(num_tokens) else None
        if offset is None:
            self.stats.pull_failures += 1
            return False
        try:
            read = self.agent.read(offset, source)
        except TransferError:
            self.agent.free(offset)
            self.stats.pull_failures += 1
            return False
        self.incoming[req.request_id] = Incoming(req, offset, source.nbytes, time.time() + TIMEOUTS.pull_s, read=read,
                                                 num_tokens=num_tokens, source=source, resume_at=hit.resume_at)
        return True

    def put(self, req: Request) -> None:
        """WRITE the longest snapshotted prefix of `req` (its handle still held) to the KV store,
        unless it adds nothing to what `req` found cached."""
        prefix = self.cache.prefix_state(req.handle) if self.store is not None else None
        if prefix is None or prefix.num_tokens <= req.num_cached:
            return
        nbytes = self.cache.state.blob_nbytes(prefix.num_tokens)
        remote = self.store.ranges.alloc(nbytes)
        local = self.agent.alloc(nbytes) if remote is not None else None
        if local is None:
            if remote is not None:
                self.store.ranges.free(remote)
            return  # the inbox or the pool is full: skip, it is only a cache
        self.cache.fence()
        self.cache.state.export_into(prefix, self.agent.view(local, nbytes))
        inbox = self.store.inbox
        region = RemoteRegion(inbox.agent, inbox.addr + remote, nbytes, inbox.device, inbox.mem)
        note = Put(remote, nbytes, req.token_ids[: prefix.num_tokens])
        try:
            transfer = self.agent.write(local, region, notif=note.encode())
        except TransferError:
            self.agent.free(local)
            self.store.ranges.free(remote)
            return
        self.outgoing.append(Outgoing(transfer, local, "", inbox.agent, remote))
        self.stats.puts += 1

    def cancel(self, request_id: str) -> Request | None:
        """Give up a reservation (failed, expired or aborted); its range stays out of use for one more
        timeout, in case a WRITE is still on its way."""
        inc = self.incoming.pop(request_id, None)
        if inc is None:
            return None
        self._quarantine.append((time.time() + self.timeout_s, inc.offset))
        return inc.request

    # ---- prefill side ------------------------------------------------------------------------------
    def push(self, req: Request) -> None:
        """Start writing `req`'s state (its handle still held; free it after this returns) to the
        decode rank of `req.push_to`, with its first token."""
        res, handle = req.push_to, req.handle
        nbytes = self.cache.state.blob_nbytes(handle.num_tokens)
        # a size mismatch means a differently configured decode rank; a late start could outlive the range
        expiring = time.time() > res.expires_at - TIMEOUTS.push_margin_s
        why = (f"the decode rank reserved {res.region.nbytes} bytes for {nbytes}" if nbytes != res.region.nbytes
               else "its reservation is about to expire" if expiring else None)
        offset = self.agent.alloc(nbytes) if why is None else None
        if offset is None:
            self._push_failed(req.request_id, res.region.agent, why or "no room in the push pool")
            return
        self.cache.fence()
        self.cache.state.export_into(handle, self.agent.view(offset, nbytes))
        try:
            transfer = self.agent.write(offset, res.region, notif=_pushed(req).encode())
        except TransferError as e:
            self.agent.free(offset)
            self._push_failed(req.request_id, res.region.agent, str(e))
            return
        self.outgoing.append(Outgoing(transfer, offset, req.request_id, res.region.agent))

    def push_prefilled(self, scheduler: Scheduler) -> None:
        """Send the state of every request `scheduler` prefilled for another rank this step, write its
        prefix to the store, free it here; then move the transfers on (`progress`)."""
        for req in scheduler.pushed:
            self.push(req)
            self.put(req)
            self.cache.free(req.handle)
            req.handle = None
        scheduler.pushed.clear()
        self.progress()

    def progress(self) -> None:
        """Release the ranges of finished WRITEs; report failed ones to their decode rank."""
        still = []
        for out in self.outgoing:
            try:
                done = self.agent.poll(out.transfer)
            except TransferError as e:
                self.agent.free(out.offset)
                if out.request_id:
                    self._push_failed(out.request_id, out.peer, str(e))
                elif self.store is not None:
                    self.store.ranges.free(out.store_offset)
                continue
            if done:
                self.agent.free(out.offset)
                self.stats.pushed += bool(out.request_id)
                self.stats.bytes_out += out.transfer.nbytes
            else:
                still.append(out)
        self.outgoing = still

    # ---- peers that went away ----------------------------------------------------------------------
    def forget(self, peer: str) -> None:
        """Peer `peer` is gone (its gang restarted, its store died): drop the WRITEs still going to
        it, stop writing prefixes to it if it is our KV store, and disconnect from it. A dropped
        push concerns a request its decode rank lost with it, so it counts as no failure here; its
        range stays out of use for one timeout, in case the transfer touches it still."""
        keep = []
        for out in self.outgoing:
            if out.peer != peer:
                keep.append(out)
                continue
            self.agent.cancel(out.transfer)
            self._quarantine.append((time.time() + self.timeout_s, out.offset))
        self.outgoing = keep
        if self.store is not None and self.store.agent == peer:
            self.store = None
        self.agent.remove_peer(peer)

    def _push_failed(self, request_id: str, peer: str, why: str) -> None:
        log.warning("push of %s to %r failed (the decode rank recomputes it): %s", request_id, peer, why)
        self.stats.push_failures += 1
        send(self.agent, peer, PushFailed(request_id))  # the decode rank recomputes at once, not at expiry

    def _free_inbox_range(self, offset: int) -> None:
        try:
            self.store.ranges.free(offset)
        except ValueError:
            log.warning("ignored a Freed from the KV store %r: no put of ours is at offset %d", self.store.agent,
                        offset)


def _pushed(req: Request) -> Pushed:
    """What rides on the WRITE of `req`'s state: its first token, with that token's logprobs if it asked
    (-1 and none when its choices sample on the decode rank: n > 1)."""
    if len(req.token_ids) == req.num_given:
        return Pushed(req.request_id, -1, None, [], [], req.num_cached)
    lp = req.logprobs[-1] if req.logprobs else None
    top = lp.top if lp is not None else []
    return Pushed(req.request_id, req.token_ids[-1], lp.logprob if lp is not None else None, [t for t, _ in top],
                  [p for _, p in top], req.num_cached)


def _logprobs(message: Pushed) -> TokenLogprobs | None:
    """The first token's logprobs, if the request asked for them."""
    if message.logprob is None:
        return None
    return TokenLogprobs(message.token, message.logprob, list(zip(message.top_ids, message.top_logprobs)))
