"""`Deployment`: prefill instances, decode instances and KV stores from one spec, driven from Python.

    dep = Deployment("tiny", prefill="1xDEP1", decode="1xDEP2", kv_stores=1)
    [c] = dep.generate(["The rack hums"], SamplingParams(max_tokens=8, temperature=0))
    for out in dep.stream(dep.submit("…", params, session="chat-7")): ...
    dep.shutdown()

A request's path (DESIGN.md, P/D): the decode rank with the least state load (or the session's)
reserves room for its state; the session's KV store is asked for the longest cached prefix; the
prefill instance with the fewest queued tokens (or the session's) reads that prefix, prefills the
rest, samples the first token and pushes the state; the decode rank streams every token. Each
decode rank writes prompt + answer back to its KV store when a request finishes, so the next turn
of a session prefills only its new text. Anything failing on the way (a transfer, a prefill
instance, a KV store) costs recomputation on the decode rank, not the request.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import random
import secrets
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import ray

from rackserve.actors.instance import Instance, InstanceError
from rackserve.actors.kv_store import KVStore
from rackserve.config import ConfigError, EngineConfig
from rackserve.engine import SamplingParams
from rackserve.model.tiny import ensure_tiny
from rackserve.model.tokenizer import Tokenizer
from rackserve.placement import InstanceGroup
from rackserve.placement.planner import Plan
from rackserve.placement.ray_groups import kv_store_options


@dataclass
class _Route:
    decode: tuple[int, int]  # (decode instance, DP rank)
    prefill: tuple[int, int] | None  # None: the decode rank prefills it
    prefill_tokens: int  # tokens the prefill rank computes
    decode_tokens: int  # state the decode rank holds (prompt + max output), for its load


# EngineConfig fields that fix the layout of the state bytes moved between ranks and stores
LAYOUT_FIELDS = ("state_dtype", "dtype", "block_size")


def _role_engine_kwargs(common: dict, prefill: dict | None, decode: dict | None) -> tuple[dict, dict]:
    """The `EngineConfig` fields of prefill and decode ranks: `common` with each role's on top.

    Speculative decoding (`speculative_tokens` > 0) adds the MTP layer and its paired streams to
    the state a prefill rank pushes to a decode rank, so both sides must agree on whether it is on.
    Set on the decode side alone, the prefill side keeps the MTP layer's state as well (decode
    drafts from it) and drafts the least it can, one token (its drafts are not sent); set on the
    prefill side alone, it is refused, saying where it belongs. The state's layout (`LAYOUT_FIELDS`)
    must be the same on both sides."""
    prefill, decode = {**common, **(prefill or {})}, {**common, **(decode or {})}
    k_prefill, k_decode = prefill.get("speculative_tokens", 0), decode.get("speculative_tokens", 0)
    if k_decode and "speculative_tokens" not in prefill:
        prefill["speculative_tokens"] = 1
    elif bool(k_prefill) != bool(k_decode):
        raise ConfigError(
            f"speculative_tokens is {k_prefill} for prefill but {k_decode} for decode: with speculation the state "
            "pushed from prefill to decode carries the MTP layer, so both sides must have it on or off; set "
            "speculative_tokens in decode_engine_kwargs (or engine_kwargs) only, and prefill follows")
    defaults = EngineConfig()
    for key in LAYOUT_FIELDS:
        theirs = [kwargs.get(key, getattr(defaults, key)) for kwargs in (prefill, decode)]
        if theirs[0] != theirs[1]:
            raise ConfigError(
                f"{key} is {theirs[0]!r} for prefill but {theirs[1]!r} for decode: state pushed from prefill to "
                f"decode (and read from the KV stores) is moved as stored, so both must hold it the same way; set "
                f"{key} once in engine_kwargs")
    return prefill, decode


def _start_together(makers: list[Callable[[], Instance]]) -> list[Instance]:
    """The instances `makers` start, started side by side. A start is seconds of actors starting,
    weights loading and a rendezvous, mostly spent waiting on other processes: one after another, a
    deployment of many instances would take the sum. If one fails, the others are shut down."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(makers), 32)), thread_name_prefix="instance-start") as pool:
        futures = [pool.submit(make) for make in makers]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for f in futures:
            if f.exception() is None:
                f.result().shutdown()
        raise errors[0]
    return [f.result() for f in futures]


class Deployment:
    def __init__(self, model: str | Path = "tiny", prefill: str = "1xDEP1", decode: str = "1xDEP2",
                 kv_stores: int = 1, engine_kwargs: dict | None = None, store_memory_mb: float = 256.0,
                 timeout: float = 30.0, decode_redundant_slots: int = 0, plan: Plan | None = None,
                 placement_groups: dict | None = None, bundle_resources: dict[str, float] | None = None,
                 prefill_engine_kwargs: dict | None = None, decode_engine_kwargs: dict | None = None):
        """`prefill` / `decode`: instance shapes as the planner writes them ("2xDEP2", "DEP4",
        "AFD2+2"); `kv_stores`: KV-store actors (0: none); `engine_kwargs`: `EngineConfig` fields of
        every rank, with `prefill_engine_kwargs` / `decode_engine_kwargs` on top for one role (the
        state layout, i.e. block size and dtype, must match across roles); `decode_redundant_slots`:
        extra expert slots (EPLB replicas) per decode instance. With a `plan` (`placement.plan`) and
        its `placement_groups` (`placement.ray_groups`, made with `bundle_resources`), the instances
        and KV stores are the plan's, each rank and store where the plan put it; `prefill`, `decode`
        and `kv_stores` are then the plan's too."""
        groups = [InstanceGroup.parse(prefill, "prefill"), InstanceGroup.parse(decode, "decode")]
        if plan is None and (groups[0].count < 1 or groups[1].count < 1):
            raise ConfigError(f"prefill={prefill!r}, decode={decode!r}: a deployment needs at least one of each")
        if plan is None and kv_stores < 0:
            raise ConfigError(f"kv_stores={kv_stores} must be ≥ 0")
        self.path = str(ensure_tiny() if str(model) == "tiny" else Path(model))
        self.tokenizer = Tokenizer(self.path) if (Path(self.path) / "tokenizer.json").is_file() else None
        engine_kwargs = dict(engine_kwargs or {})
        tag = secrets.token_hex(3)
        prefill_kwargs, decode_kwargs = _role_engine_kwargs(engine_kwargs, prefill_engine_kwargs, decode_engine_kwargs)
        # the stores hold the state layout the ranks write (with the MTP layer when decode speculates)
        store_kwargs = {**engine_kwargs, "speculative_tokens": prefill_kwargs.get("speculative_tokens", 0)}
        role_kwargs = {"prefill": {"engine_kwargs": prefill_kwargs},
                       "decode": {"engine_kwargs": decode_kwargs, "redundant_slots": decode_redundant_slots}}
        common = {"timeout": timeout, "kv": True}

        def new_store(i: int, options: dict):
            options = {"num_cpus": 0, "max_concurrency": 8, **options}
            return ray.remote(KVStore).options(**options).remote(self.path, store_memory_mb,
                                                                 engine_kwargs=store_kwargs, name=f"kvstore{i}-{tag}")

        if plan is None:
            makers = [(g.role, functools.partial(Instance, self.path, dep=g.size, expert_ranks=g.expert_ranks,
                                                 name=f"{g.role}{i}-{tag}", **common, **role_kwargs[g.role]))
                      for g in groups for i in range(g.count)]
            self.stores = [new_store(i, {}) for i in range(kv_stores)]
        else:
            if not {"prefill", "decode"} <= {p.role for p in plan.instances}:
                raise ConfigError("the plan needs at least one prefill and one decode instance")
            makers = [(p.role, functools.partial(Instance.from_plan, p, placement_groups[p.name], self.path,
                                                 bundle_resources, **common, **role_kwargs[p.role]))
                      for p in plan.instances]
            self.stores = [new_store(i, kv_store_options(s, num_cpus=0)) for i, s in enumerate(plan.kv_stores)]
        try:
            started = _start_together([make for _, make in makers])
        except BaseException:
            for store in self.stores:
                ray.kill(store)
            raise
        self.decode, self.prefill = ([inst for (r, _), inst in zip(makers, started, strict=True) if r == role]
                                     for role in ("decode", "prefill"))
        self.dead_stores: set[int] = set()
        self._routes: dict[str, _Route] = {}
        self._decode_load: Counter = Counter()  # (instance, rank) -> state tokens held
        self._prefill_load: Counter = Counter()  # (instance, rank) -> tokens queued for prefill
        self._sessions: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {}  # -> (decode, prefill) ranks
        self._ids = itertools.count()
        self._seeds = random.Random()
        self._lock = threading.Lock()
        self._connect()
        for inst in self.prefill + self.decode:
            inst.on_restart = lambda _: self._connect()

    # ---- wiring --------------------------------------------------------------------------------------
    def _store_of(self, index: int) -> int | None:
        """The KV store of the `index`-th rank (round robin over the live stores)."""
        live = [i for i in range(len(self.stores)) if i not in self.dead_stores]
        return live[index % len(live)] if live else None

    def _connect(self) -> None:
        """Introduce every rank's agent to the agents it talks to: prefill ranks to every decode rank
        and KV store; every rank to its KV store, with an inbox there."""
        store_meta = {}
        for i, store in enumerate(self.stores):
            try:
                store_meta[i] = ray.get(store.metadata.remote())
            except ray.exceptions.RayActorError:
                self.dead_stores.add(i)
        decode_meta = [m for inst in self.decode for m in inst.kv_metadata()]
        index = itertools.count()
        for role, insts in (("decode", self.decode), ("prefill", self.prefill)):
            for inst in insts:
                links = []
                for meta in inst.kv_metadata():
                    k = self._store_of(next(index))
                    inbox = self._call_store(k, "add_writer", meta) if k is not None else None
                    links.append((store_meta[k], inbox) if inbox is not None else None)
                peers = list(store_meta.values()) + (decode_meta if role == "prefill" else [])
                inst.kv_connect(peers, links)

    def _call_store(self, k: int, method: str, *args):
        """A KV store call; None (and the store counted dead) if the store is gone."""
        try:
            return ray.get(getattr(self.stores[k], method).remote(*args))
        except ray.exceptions.RayActorError:
            self.dead_stores.add(k)
            return None

    # ---- requests ------------------------------------------------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, session: str | None = None) -> str:
        """Route a request (see the module docstring); returns its id. Requests of one `session`
        go to the same ranks, where their history is cached."""
        params = params or SamplingParams()
        if params.seed is None:  # prefill samples the first token, decode the rest: one seed for both
            params = replace(params, seed=self._seeds.getrandbits(63))
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) and self.tokenizer else prompt
        if isinstance(ids, str):
            raise ValueError("this model has no tokenizer.json; send token ids instead of text")
        # routing state is shared with streams ending on other threads: choose and count under the
        # lock, talk to the actors outside it
        with self._lock:
            decode_at, prefill_at = self._sessions.get(session, (None, None))
            if decode_at is None:
                decode_at = min(((i, r) for i, inst in enumerate(self.decode) for r in range(inst.dep)),
                                key=lambda key: self._decode_load[key])
            route = _Route(decode_at, None, 0, len(ids) + params.max_tokens)
            self._decode_load[decode_at] += route.decode_tokens
            request_id = f"req-{next(self._ids)}-{secrets.token_hex(3)}"
            self._routes[request_id] = route
        try:
            _, reservation = self.decode[decode_at[0]].reserve(ids, params, request_id, rank=decode_at[1])
        except BaseException:
            self._end(request_id, finished=True)
            raise
        if reservation is not None:
            k = self._store_of(self._rank_index(decode_at))
            hit = self._call_store(k, "lookup", ids) if k is not None else None
            with self._lock:
                if prefill_at is None:
                    prefill_at = min(((i, r) for i, inst in enumerate(self.prefill) for r in range(inst.dep)),
                                     key=lambda key: self._prefill_load[key])
                route.prefill, route.prefill_tokens = prefill_at, len(ids) - (hit[0] if hit else 0)
                self._prefill_load[prefill_at] += route.prefill_tokens
            # a prefill instance found dead here restarts and takes it; if it cannot, the decode
            # rank's reservation expires and it prefills the request itself
            try:
                self.prefill[prefill_at[0]].submit(ids, params, request_id, rank=prefill_at[1], push_to=reservation,
                                                   cached=hit)
            except InstanceError:
                pass
        if session is not None:
            with self._lock:
                self._sessions[session] = (decode_at, prefill_at)
        return request_id

    def _rank_index(self, at: tuple[int, int]) -> int:
        return sum(inst.dep for inst in self.decode[:at[0]]) + at[1]

    def stream(self, request_id: str) -> Iterator[dict]:
        """The request's outputs from its decode rank (see `Instance.stream`); closing the stream
        early aborts the request and frees its state."""
        route, finished = self._routes[request_id], False
        try:
            for out in self.decode[route.decode[0]].stream(request_id):
                self._prefilled(route)
                finished = out["finished"]
                yield out
        finally:
            self._end(request_id, finished)

    async def astream(self, request_id: str) -> AsyncIterator[dict]:
        """`stream` for asyncio callers (the HTTP server)."""
        route, finished = self._routes[request_id], False
        try:
            async for out in self.decode[route.decode[0]].astream(request_id):
                self._prefilled(route)
                finished = out["finished"]
                yield out
        finally:  # not awaited: under a cancelled task (a client gone) an await here would not run
            asyncio.get_running_loop().run_in_executor(None, self._end, request_id, finished)

    def _prefilled(self, route: _Route) -> None:
        """The first output is out: the request no longer counts in its prefill rank's queue."""
        if route.prefill is not None and route.prefill_tokens:
            with self._lock:
                self._prefill_load[route.prefill] -= route.prefill_tokens
                route.prefill_tokens = 0

    def _end(self, request_id: str, finished: bool) -> None:
        self._prefilled(self._routes[request_id])
        with self._lock:
            route = self._routes.pop(request_id)
            self._decode_load[route.decode] -= route.decode_tokens
        if not finished:  # the caller went away: stop it on both sides and free its state
            self.decode[route.decode[0]].abort(request_id, rank=route.decode[1])
            if route.prefill is not None:
                self.prefill[route.prefill[0]].abort(request_id, rank=route.prefill[1])

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 sessions: list[str | None] | None = None) -> list[dict]:
        """Run prompts to completion: per prompt, its token ids, text, finish reason and cached
        prompt tokens."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.submit(p, sp, s) for p, sp, s in zip(prompts, params_list, sessions or [None] * len(prompts),
                                                          strict=True)]
        results = []
        for request_id in ids:
            tokens, text, reason, cached = [], "", None, 0
            for out in self.stream(request_id):
                tokens += out["new_token_ids"]
                text += out["new_text"]
                reason, cached = out.get("error") or out["finish_reason"], out.get("num_cached_tokens", 0)
            results.append({"token_ids": tokens, "text": text, "finish_reason": reason, "num_cached_tokens": cached})
        return results

    def stats(self) -> dict:
        """Every instance's stats and every live KV store's."""
        stores = [self._call_store(k, "stats") for k in range(len(self.stores))]
        return {"prefill": [i.stats() for i in self.prefill], "decode": [i.stats() for i in self.decode],
                "kv_stores": stores}

    def shutdown(self) -> None:
        for inst in self.prefill + self.decode:
            inst.shutdown()
        for store in self.stores:
            ray.kill(store)
