"""`DPRank`: one data-parallel (attention) rank of an instance, a thin actor over `Engine`.

In DEP mode it also holds its share of the routed experts; in attention–FFN split mode it holds
none and its MoE layers send every token to the expert ranks. Requests come in through `submit`,
outputs (`RequestOutput`s) go out through `poll_all`, which each consumer's output pump for this
rank long-polls: a consumer (an `InstanceClient`: the instance's owner, or one ingress replica)
gets the outputs of the requests it submitted, and only those. A consumer that stops polling for
`TIMEOUTS.consumer_silent_s` (its process died) has its requests aborted, so their state is freed and
nobody's outputs pile up. Between steps the rank publishes its `load()` for routers.

The engine is not thread-safe, so actor threads never touch it: they put a `Submit`, an
`AbortRequest` or an `EngineCall` in the rank's inbox, which the step loop drains before each step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rackserve.actors.gang_member import GangMember, GangSpec
from rackserve.engine import Engine, RequestOutput
from rackserve.messages import RankLoad, Submit
from rackserve.models.tokenizer import Tokenizer
from rackserve.timeouts import TIMEOUTS
from rackserve.transfer.kv_agent import KVAgent, KVReservation, RemoteRegion, TransferError

log = logging.getLogger(__name__)


# ---- the inbox: what actor threads hand the step loop (the engine is not thread-safe) ---------------
@dataclass
class AbortRequest:
    request_id: str


@dataclass
class EngineCall:
    """Run `fn(engine)` between steps; its result, or what it raised, goes to `future`."""

    fn: Callable[[Engine], Any]
    future: Future = field(default_factory=Future)


InboxItem = Submit | AbortRequest | EngineCall  # a Submit: `Engine.add_request`, a refusal its one output


class DPRank(GangMember):
    role = "DP rank"

    def __init__(self, rank: int, world_size: int):
        super().__init__(rank, world_size)
        self.engine: Engine | None = None
        self._inbox: list[InboxItem] = []
        self._outputs: dict[str, list[RequestOutput]] = {}  # request id -> outputs not yet polled
        self._consumer: dict[str, str] = {}  # request id -> the consumer that polls for it
        self._ready: dict[str, set[str]] = {}  # consumer -> its requests with outputs to take
        self._polled: dict[str, float] = {}  # consumer -> when it last polled (time.monotonic())
        self._load = RankLoad()

    def setup(self, spec: GangSpec, members: list) -> None:
        """Join the gang (`members`: every member's handle, in rank order), load the model with this
        rank's expert slots, start the step loop."""
        model, config = self._join(spec, members)
        tokenizer = Tokenizer(spec.checkpoint) if (Path(spec.checkpoint) / "tokenizer.json").is_file() else None
        agent = None
        if spec.kv_name:
            agent = KVAgent(f"{spec.kv_name}-r{self.rank}", int(config.kv_pool_mb * 2**20), config.device)
        self.engine = Engine(model, tokenizer, config, gang=self.gang, kv=agent)
        self._start()

    # ---- disaggregated prefill/decode: everything touching the engine runs in the step loop ---------
    def kv_metadata(self) -> tuple[str, bytes]:
        """(this rank's NIXL agent's name, its metadata)."""
        return self.engine.kv.agent.name, self.engine.kv.agent.metadata()

    def kv_connect(self, peers: list[bytes], store: tuple[bytes, RemoteRegion] | None = None,
                   forget: list[str] = ()) -> None:
        """Forget the agents `forget`, which are gone (see `Engine.forget_peers`), learn peer agents
        (decode ranks to push to, KV stores to read from) and attach the KV store to write prefixes
        to: (its metadata, this rank's inbox there)."""

        def connect(engine: Engine) -> None:
            if forget:
                engine.forget_peers(list(forget))
            for metadata in peers:
                try:
                    engine.kv.agent.add_peer(metadata)
                except TransferError as e:  # unreachable (a store whose node died?): its successor is introduced
                    log.warning("DP rank %d: a peer was not learned: %s", self.rank, e)
            if store is not None:
                engine.attach_store(*store)

        self._call(connect)

    def reserve(self, req: Submit) -> KVReservation | None:
        """Decode side: a reservation for a request another rank prefills, or None when the pool is
        full and this rank prefills it itself; `req.consumer` polls for its outputs."""
        with self._lock:
            self._expect(req.request_id, req.consumer)
        try:
            return self._call(lambda engine: engine.reserve_push(req.prompt, req.params, request_id=req.request_id,
                                                                 resumed=req.resumed))
        except Exception:  # refused: nothing will be streamed for it
            with self._lock:
                self._drop(req.request_id)
            raise

    def _call(self, fn: Callable[[Engine], Any]):
        """`fn(engine)`, run in the step loop between steps; its result."""
        if self.error:
            raise RuntimeError(self.error)
        call = EngineCall(fn)
        with self._lock:
            self._inbox.append(call)
        self._wake.set()
        return call.future.result()

    def _expect(self, request_id: str, consumer: str) -> None:
        """Keep `request_id`'s outputs for `consumer` (call under `_lock`)."""
        self._outputs[request_id] = []
        self._consumer[request_id] = consumer
        self._polled[consumer] = time.monotonic()  # alive now: its pump polls from here on

    def _drop(self, request_id: str) -> None:
        self._outputs.pop(request_id, None)
        self._ready.get(self._consumer.pop(request_id, None), set()).discard(request_id)

    def _emit(self, out: RequestOutput) -> None:
        """Keep `out` for the consumer of its request, if someone polls for it (call under `_lock`)."""
        if out.request_id in self._outputs:
            self._outputs[out.request_id].append(out)
            self._ready.setdefault(self._consumer[out.request_id], set()).add(out.request_id)

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, req: Submit) -> None:
        """Queue a request (see `Submit`); a gang that failed raises here, before the request is lost."""
        if self.error:
            raise RuntimeError(self.error)
        with self._lock:
            self._inbox.append(req)
            if req.push_to is None:  # a pushed request's outputs belong to its decode rank
                self._expect(req.request_id, req.consumer)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(AbortRequest(request_id))
            self._drop(request_id)
        self._wake.set()

    def poll_all(self, timeout: float = 1.0, consumer: str = "") -> dict[str, list[RequestOutput]]:
        """{request id: its outputs since the last call} for every request of `consumer` with new
        outputs, in order, a finished request's last (it is then forgotten); waits up to `timeout` s
        for any. One caller per consumer: its output pump for this rank, so that a request waiting for
        its state or its turn holds no actor thread."""
        with self._lock:
            self._polled[consumer] = time.monotonic()
            self._lock.wait_for(lambda: self.error or self._ready.get(consumer), timeout)
            self._polled[consumer] = time.monotonic()
            if self.error:
                raise RuntimeError(self.error)
            ready = {r: self._outputs[r] for r in self._ready.pop(consumer, ())}
            for request_id, outs in ready.items():
                if outs[-1].finished:
                    self._drop(request_id)
                else:
                    self._outputs[request_id] = []
            return ready

    def load(self, blocks_since: int | None = None) -> RankLoad:
        """This rank's load as of its last step (`Engine.load`), for routers, with the blocks its cache
        stored and evicted from event `blocks_since` on (`BlockLog.since`; None: every block it holds)."""
        if self.engine is None:
            return self._load
        return replace(self._load, blocks=self.engine.cache.events.since(blocks_since))

    def _stats(self) -> dict:
        return self.engine.stats()

    def _abort_orphans(self) -> None:
        """Abort the requests of consumers that stopped polling (call under `_lock`)."""
        now = time.monotonic()
        gone = {c for c, at in self._polled.items() if now - at > TIMEOUTS.consumer_silent_s}
        for request_id in [r for r, c in self._consumer.items() if c in gone]:
            self._inbox.append(AbortRequest(request_id))
            self._drop(request_id)
        for consumer in gone:
            del self._polled[consumer]
            self._ready.pop(consumer, None)

    # ---- the step loop ---------------------------------------------------------------------------
    def _step(self) -> bool:
        self._drain_inbox()
        outputs = self.engine.step()
        load = self.engine.load()
        with self._lock:
            for out in outputs:
                self._emit(out)
            self._load = load
            self._abort_orphans()
            self._lock.notify_all()
        return bool(self.engine.gang_tokens.any()) or self.engine.gang_busy

    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        if inbox:
            self._wake_others()
        for item in inbox:
            if isinstance(item, Submit):
                self._add(item)
            elif isinstance(item, AbortRequest):
                self.engine.abort(item.request_id)
            else:
                try:
                    item.future.set_result(item.fn(self.engine))
                except Exception as e:  # noqa: BLE001 - handed to the caller, whose call raises it
                    item.future.set_exception(e)

    def _add(self, item: Submit) -> None:
        try:
            self.engine.add_request(item.prompt, item.params, request_id=item.request_id, push_to=item.push_to,
                                    cached=item.cached, resumed=item.resumed)
        except ValueError as e:
            with self._lock:
                self._emit(RequestOutput(item.request_id, [], "", True, "error", error=str(e)))
