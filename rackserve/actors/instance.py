"""`Instance`: one model instance as a gang of rank actors stepping in lockstep, driven from Python.

    inst = Instance("tiny", dep=2)                     # DEP2: 2 DP ranks, each holding half the experts
    inst = Instance("tiny", dep=2, expert_ranks=2)     # split: 2 attention ranks + 2 expert ranks
    [c] = inst.generate(["The rack hums"], SamplingParams(max_tokens=8, temperature=0))
    inst.shutdown()

Members are DP ranks `0 … dep-1`, then expert ranks (split mode). In DEP mode each DP rank holds its
share of the expert slots itself (one process per GPU, as the serving engines run it: no second
CUDA context on the GPU, no hop between two processes on it). The routed experts are laid out by
`placement.rebalance` (uniform load until load is counted); each request goes to the DP rank with
the fewest requests outstanding.

Outputs: one pump thread per DP rank long-polls the rank for the outputs of all its requests at
once and puts each request's into its stream, which `stream` and `astream` read; so a rank answers
one poll at a time however many requests it runs, and a request waiting for its turn or its state
holds none of the rank actor's threads.

Faults: a member that dies or stops answering fails the gang (survivors notice at their next
exchange, within `timeout`); every request in flight ends with an `InstanceError` naming the member,
and the instance restarts its gang, so the next requests are served.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict
from pathlib import Path

import ray
import torch
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rackserve.actors.dp_rank import DPRank
from rackserve.actors.expert_rank import ExpertRank
from rackserve.actors.gang_member import GangSpec
from rackserve.collective import RendezvousServer
from rackserve.config import ConfigError, EngineConfig, ModelConfig
from rackserve.engine import SamplingParams
from rackserve.model.tiny import ensure_tiny
from rackserve.placement import planner, rebalance

PING_TIMEOUT_S = 5.0  # a member that does not answer a ping this long after a failure counts as stalled
POLL_TIMEOUT_S = 1.0  # an output pump's long-poll: an idle DP rank answers one poll per second


class InstanceError(RuntimeError):
    """The instance's gang failed under a request; the message names the member and what to do."""


class _Stream:
    """One request's outputs on their way to its reader: the output pump of its DP rank (a thread)
    puts them, `Instance.stream` takes them blocking, `Instance.astream` awaiting (the pump wakes
    its event loop). A stream ends with a finished output or an `InstanceError`."""

    def __init__(self, rank: int, generation: int):
        self.rank, self.generation = rank, generation
        self._items: list = []  # output dicts, maybe an InstanceError last
        self._ready = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None  # an asyncio reader's, from its first take
        self._event: asyncio.Event | None = None

    def put(self, items: list) -> None:
        with self._ready:
            self._items += items
            self._ready.notify()
            loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._event.set)
            except RuntimeError:  # the reader's event loop is closed: nobody waits
                pass

    def take(self) -> list[dict]:
        """The outputs put since the last take (waits for one); raises the error that ended the stream."""
        with self._ready:
            self._ready.wait_for(lambda: self._items)
            return self._pop()

    async def atake(self) -> list[dict]:
        """`take` for an asyncio reader: awaits instead of blocking its event loop."""
        with self._ready:
            if self._loop is None:
                self._loop, self._event = asyncio.get_running_loop(), asyncio.Event()
        while True:
            with self._ready:
                if self._items:
                    self._event.clear()  # sets still queued are for the items taken here
                    return self._pop()
            await self._event.wait()

    def _pop(self) -> list[dict]:
        """The outputs before the first error (the error stays, for the next take), or that error."""
        end = next((i for i, item in enumerate(self._items) if isinstance(item, InstanceError)), len(self._items))
        if end == 0:
            raise self._items[0]
        outs, self._items = self._items[:end], self._items[end:]
        return outs


class Instance:
    def __init__(self, model: str | Path = "tiny", dep: int = 2, expert_ranks: int = 0, redundant_slots: int = 0,
                 engine_kwargs: dict | None = None, actor_options: dict | None = None, timeout: float = 30.0,
                 placement_group: PlacementGroup | None = None, name: str = "instance", kv: bool = False):
        """`dep` DP ranks; `expert_ranks` > 0: attention–FFN split mode with that many expert
        ranks; `redundant_slots`: extra expert slots (replicas) over the instance; `engine_kwargs`:
        `EngineConfig` fields of every rank; `actor_options`: Ray options of every member; with a
        `placement_group` (one bundle per member, as `placement.ray_groups` makes them) member i runs
        in bundle i; `timeout` (s): a member silent this long fails the gang; `kv`: give every DP
        rank a NIXL agent, for disaggregated prefill/decode (see `Deployment`)."""
        if not isinstance(dep, int) or dep < 1:
            raise ConfigError(f"dep={dep!r} must be an integer ≥ 1 (the number of DP ranks)")
        if not isinstance(expert_ranks, int) or expert_ranks < 0:
            raise ConfigError(f"expert_ranks={expert_ranks!r} must be an integer ≥ 0 (0: DEP mode)")
        if not isinstance(redundant_slots, int) or redundant_slots < 0:
            raise ConfigError(f"redundant_slots={redundant_slots!r} must be an integer ≥ 0")
        self.path = str(ensure_tiny() if str(model) == "tiny" else Path(model))
        if not (Path(self.path) / "config.json").is_file():
            raise ConfigError(f"model={str(model)!r}: no config.json in {self.path}; pass a checkpoint directory "
                              "(config.json + *.safetensors) or 'tiny' for the built-in tiny model")
        config = ModelConfig.from_pretrained(self.path)
        try:
            EngineConfig(**(engine_kwargs or {})).resolve(config)
        except TypeError as e:
            raise ConfigError(f"engine_kwargs: {e}; use EngineConfig's fields") from None
        holders = expert_ranks or dep
        self.slots_per_rank = -(-(config.n_routed_experts + redundant_slots) // holders)
        self.dep, self.num_expert_ranks, self.world = dep, expert_ranks, dep + expert_ranks
        if placement_group is not None and placement_group.bundle_count < self.world:
            raise ConfigError(f"the placement group has {placement_group.bundle_count} bundles; this instance needs "
                              f"one per member ({dep} DP + {expert_ranks} expert ranks = {self.world})")
        self.shape = f"DEP{dep}" if not expert_ranks else f"AFD{dep}+{expert_ranks}"
        self.name, self.timeout = name, timeout
        self._engine_kwargs, self._actor_options = dict(engine_kwargs or {}), dict(actor_options or {})
        self._placement_group = placement_group
        num_moe_layers = config.num_hidden_layers + config.num_nextn_predict_layers  # the MTP layers' rows last
        self._layout = torch.as_tensor(rebalance(torch.ones(num_moe_layers, config.n_routed_experts),
                                                 num_slots=holders * self.slots_per_rank,
                                                 num_ranks=holders).phy2log).tolist()
        self._lock = threading.RLock()  # the gang (generation, members); a restart holds it for seconds
        self._streams: dict[str, _Stream] = {}  # request id -> its outputs' stream (DP rank, gang generation)
        self._streams_lock = threading.Lock()  # held only to read or change `_streams`, never across a call
        self._closed = False
        self._failures: dict[int, str] = {}  # gang generation -> why it failed
        self._ids = itertools.count()
        self.generation = -1
        self.on_restart = None  # called with the instance after its gang restarted (e.g. to reconnect KV peers)
        self._kv = kv
        self._start()

    @classmethod
    def from_plan(cls, planned: planner.Instance, placement_group: PlacementGroup, model: str | Path = "tiny",
                  bundle_resources: dict[str, float] | None = None, **kwargs) -> Instance:
        """The instance `planned` (from `placement.plan`) in its placement group (from
        `placement.ray_groups.placement_groups`, made with the same `bundle_resources`, default
        {"GPU": 1}); each member reserves its bundle's resources."""
        res = dict(bundle_resources or {"GPU": 1.0})
        options = {"num_gpus": res.pop("GPU", 0), "num_cpus": res.pop("CPU", 0), "resources": res,
                   **kwargs.pop("actor_options", {})}
        return cls(model, dep=len(planned.gpus), expert_ranks=len(planned.expert_gpus), actor_options=options,
                   placement_group=placement_group, name=planned.name, **kwargs)

    # ---- the gang ----------------------------------------------------------------------------------
    def _start(self) -> None:
        """Create the members, join them into a gang, load the model on each, start their loops."""
        self.generation += 1
        secret = secrets.token_hex(16)
        self._server = RendezvousServer(self.world, secret)
        self.members = [self._actor(i).remote(i, self.world) for i in range(self.world)]
        host, port = ray.get(self.members[0].endpoint.remote())
        holders = (self.dep, self.world) if self.num_expert_ranks else (0, self.dep)
        spec = GangSpec(self.path, self._engine_kwargs, self._layout, self.slots_per_rank, holders,
                        f"tcp://{host}:{port}", self._server.address, secret, self.timeout,
                        kv_name=f"{self.name}-{secret[:8]}" if self._kv else None)
        ray.get([m.setup.remote(spec) for m in self.members])
        for rank in range(self.dep):
            threading.Thread(target=self._pump, args=(self.generation, rank, self.members[rank]), daemon=True,
                             name=f"{self.name}-g{self.generation}-pump{rank}").start()

    def _actor(self, i: int):
        cls = DPRank if i < self.dep else ExpertRank
        options = {"num_cpus": 0, "max_concurrency": 16, **self._actor_options}
        if self._placement_group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(self._placement_group,
                                                                              placement_group_bundle_index=i)
        return ray.remote(cls).options(**options)

    def _member_name(self, i: int) -> str:
        return f"DP rank {i}" if i < self.dep else f"expert rank {i}"

    def _fail(self, generation: int, cause: BaseException) -> str:
        """Record why gang `generation` failed (naming the members at fault) and restart it, once
        however many threads find it failed; returns the reason."""
        with self._lock:
            if generation == self.generation:
                self._failures[generation] = self._diagnose(cause)
                self._restart()
            return self._failures[generation]

    def _diagnose(self, cause: BaseException) -> str:
        refs = [m.ping.remote() for m in self.members]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PING_TIMEOUT_S)
        culprits, errors = [], []
        for i, ref in enumerate(refs):
            if ref not in ready:
                culprits.append(f"{self._member_name(i)} stopped answering")
                continue
            try:
                info = ray.get(ref)
            except ray.exceptions.RayActorError:
                culprits.append(f"{self._member_name(i)} died")
                continue
            if info["error"]:
                errors.append(info["error"])
        detail = "; ".join(culprits) if culprits else (errors[0] if errors else f"{type(cause).__name__}: {cause}")
        return f"{self.shape} instance {self.name!r} failed: {detail}"

    def _restart(self) -> None:
        self._kill()
        self._start()
        if self.on_restart is not None:
            self.on_restart(self)

    def _kill(self) -> None:
        for member in self.members:
            ray.kill(member)
        self._server.close()

    # ---- requests ------------------------------------------------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
               rank: int | None = None, push_to: list | None = None, cached: tuple[int, list] | None = None) -> str:
        """Queue a request on DP rank `rank` (default: the least loaded); returns its id. A gang
        found dead here is restarted first, so the request is served. `push_to`/`cached`: see
        `DPRank.submit` (disaggregated prefill)."""
        request_id = request_id or f"{self.name}-{next(self._ids)}"
        self._on_rank(rank, request_id, "submit", prompt, asdict(params or SamplingParams()), push_to, cached,
                      own=push_to is None)  # a pushed request is streamed from its decode instance
        return request_id

    def reserve(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                rank: int | None = None) -> tuple[str, list | None]:
        """Decode side of P/D: (request id, a reservation in wire form for the prefill rank, or None
        when the rank's pool is full and it prefills the request itself). Stream it as usual."""
        request_id = request_id or f"{self.name}-{next(self._ids)}"
        return request_id, self._on_rank(rank, request_id, "reserve", prompt, asdict(params))

    def _on_rank(self, rank: int | None, request_id: str, method: str, *args, own: bool = True):
        """Call `method(request_id, *args)` on DP rank `rank` (default: the least loaded), waking the
        whole gang; `own`: stream the request from here (it counts in the rank's load). The lock is
        held only to choose: the call waits for the rank's next step boundary (a reservation), and
        concurrent submits must reach the rank in the same step, not one per step."""
        for attempt in (0, 1):
            with self._lock:
                generation, members = self.generation, self.members
                at = self._least_loaded() if rank is None else rank
                if own:  # counted before the call, so that concurrent submits spread over the ranks
                    with self._streams_lock:
                        self._streams[request_id] = _Stream(at, generation)
            target = members[at]
            try:  # every member must resume stepping with it
                result, *_ = ray.get([getattr(target, method).remote(request_id, *args)] +
                                     [m.wake.remote() for m in members if m is not target])
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                self._forget(request_id)
                if isinstance(getattr(e, "cause", None), ValueError):
                    raise e.cause from None  # the rank refused this request (e.g. too long): not the gang's fault
                reason = self._fail(generation, e)
                if attempt:
                    raise InstanceError(f"{reason}; a fresh gang failed too, check the members' logs") from None
                continue
            return result
        raise AssertionError("unreachable")

    def _least_loaded(self) -> int:
        """The DP rank streaming the fewest requests of the current gang (call under `_lock`)."""
        loads = [0] * self.dep
        with self._streams_lock:
            for stream in self._streams.values():
                loads[stream.rank] += stream.generation == self.generation
        return loads.index(min(loads))

    def kv_metadata(self) -> list[bytes]:
        """The NIXL agent metadata of every DP rank (an instance made with `kv=True`)."""
        return ray.get([m.kv_metadata.remote() for m in self.members[:self.dep]])

    def kv_connect(self, peers: list[bytes], stores: list[tuple[bytes, list] | None] | None = None) -> None:
        """Every DP rank learns `peers`; DP rank i writes prefixes to `stores[i]` (metadata, inbox)."""
        stores = stores or [None] * self.dep
        ray.get([m.kv_connect.remote(peers, store) for m, store in zip(self.members[:self.dep], stores, strict=True)])

    def stream(self, request_id: str) -> Iterator[dict]:
        """The request's outputs as they come: dicts with new_text, new_token_ids, finished, …;
        raises `InstanceError` if the gang fails under it."""
        outputs = self._stream_of(request_id)
        try:
            while True:
                outs = outputs.take()
                yield from outs
                if outs[-1]["finished"]:
                    return
        finally:
            self._forget(request_id)

    async def astream(self, request_id: str) -> AsyncIterator[dict]:
        """`stream` for asyncio callers (an HTTP server): awaits outputs without blocking the event loop."""
        outputs = self._stream_of(request_id)
        try:
            while True:
                outs = await outputs.atake()
                for out in outs:
                    yield out
                if outs[-1]["finished"]:
                    return
        finally:
            self._forget(request_id)

    def _stream_of(self, request_id: str) -> _Stream:
        with self._streams_lock:
            return self._streams[request_id]

    def _forget(self, request_id: str) -> _Stream | None:
        with self._streams_lock:
            return self._streams.pop(request_id, None)

    def _pump(self, generation: int, rank: int, member) -> None:
        """The output pump of DP rank `rank` of gang `generation`: long-polls the rank and puts each
        request's outputs into its stream, until the gang fails (it then ends the streams of the
        rank's requests with the reason, after the restart) or the instance shuts down."""
        while True:
            try:
                ready = ray.get(member.poll_all.remote(POLL_TIMEOUT_S))
            except ray.exceptions.RayError as e:  # the rank or its gang failed, or the instance was shut down
                if not self._closed:
                    why = f"{self.shape} instance {self.name!r} failed and did not restart; check the members' logs"
                    try:
                        why = f"{self._fail(generation, e)}. The instance restarted its gang; resubmit the request"
                    finally:  # whatever the restart did, no reader waits forever
                        self._end_streams(generation, rank, why)
                return
            with self._streams_lock:
                for request_id, outs in ready.items():
                    stream = self._streams.get(request_id)
                    if stream is not None and stream.generation == generation:
                        stream.put(outs)

    def _end_streams(self, generation: int, rank: int | None, why: str) -> None:
        """End the streams of gang `generation`'s requests on DP rank `rank` (None: every rank) with
        an `InstanceError` saying `why`."""
        with self._streams_lock:
            for request_id, stream in self._streams.items():
                if stream.generation == generation and rank in (None, stream.rank):
                    stream.put([InstanceError(f"request {request_id} was lost: {why}")])

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | None = None) -> list[dict]:
        """Run prompts to completion across the ranks: per prompt, its token ids, text and finish
        reason (the error message for input the engine refused)."""
        ids = [self.submit(p, params) for p in prompts]
        results = []
        for request_id in ids:
            tokens, text, reason = [], "", None
            for out in self.stream(request_id):
                tokens += out["new_token_ids"]
                text += out["new_text"]
                reason = out.get("error") or out["finish_reason"]
            results.append({"token_ids": tokens, "text": text, "finish_reason": reason})
        return results

    def abort(self, request_id: str, rank: int | None = None) -> None:
        """Stop a request and free its state (a request of a failed gang is already gone). `rank`:
        where a request not streamed from here runs (a pushed prefill)."""
        stream = self._forget(request_id)
        with self._lock:
            rank, generation = ((stream.rank, stream.generation) if stream is not None
                                else (rank, self.generation if rank is not None else None))
            if generation == self.generation:
                try:
                    ray.get(self.members[rank].abort.remote(request_id))
                except ray.exceptions.RayActorError:
                    pass

    def stats(self) -> dict:
        """The instance's shape, gang restarts so far, and every member's counters."""
        for attempt in (0, 1):
            with self._lock:
                members, generation = list(self.members), self.generation
            try:
                counters = ray.get([m.stats.remote() for m in members])
                break
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                reason = self._fail(generation, e)  # found dead here: restart it, report the fresh gang
                if attempt:
                    raise InstanceError(f"{reason}; a fresh gang failed too, check the members' logs") from None
        return {"name": self.name, "shape": self.shape, "restarts": self.generation,
                "failures": list(self._failures.values()), "members": counters}

    def ping(self) -> list[dict]:
        """Every member's liveness and whereabouts (see `GangMember.ping`)."""
        return ray.get([m.ping.remote() for m in self.members])

    def shutdown(self) -> None:
        """Stop every member (one that already died is skipped) and release them; a stream still
        open ends with an `InstanceError`."""
        with self._lock:
            self._closed = True  # first: the output pumps then end with their members, restarting nothing
            for member in self.members:
                try:
                    ray.get(member.shutdown.remote())
                except ray.exceptions.RayActorError:
                    pass
            self._kill()
            self._end_streams(self.generation, None, f"{self.shape} instance {self.name!r} was shut down")
