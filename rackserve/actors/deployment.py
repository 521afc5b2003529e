"""`Deployment`: prefill instances, decode instances and KV stores from one spec, driven from Python.

    dep = Deployment("tiny", prefill="1xDEP1", decode="1xDEP2", kv_stores=1)
    [c] = dep.generate(["The rack hums"], SamplingParams(max_tokens=8, temperature=0))
    for out in dep.stream(dep.submit("…", params, session="chat-7")): ...
    dep.shutdown()

The deployment *owns* the data plane: it creates the instances and KV stores, introduces their NIXL
agents, restarts a failed gang (once, whoever finds it) and reconnects it, and gathers the ranks'
load reports every `LOAD_PERIOD_S`. Requests go through a `DeploymentClient` (routing, the P/D path,
streaming: see `rackserve.actors.deployment_client`): the deployment keeps one for its own Python API,
and any other process (an ingress replica) can make its own from `view()`, `members_of`,
`gang_failed` and `loads`, which is what the serving data plane exposes (`rackserve.serve.controller`).
Each decode rank writes prompt + answer back to its KV store when a request finishes, so the next
turn of a session prefills only its new text.
"""

from __future__ import annotations

import functools
import itertools
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ray

from rackserve.actors.deployment_client import DeploymentClient
from rackserve.actors.instance import Instance
from rackserve.actors.kv_store import KVStore
from rackserve.config import ConfigError, EngineConfig
from rackserve.engine import Completion, RequestOutput, SamplingParams
from rackserve.models import resolve
from rackserve.models.tokenizer import Tokenizer
from rackserve.placement import InstanceGroup
from rackserve.placement.planner import Plan
from rackserve.placement.ray_groups import kv_store_options
from rackserve.serve.router import RankKey

LOAD_PERIOD_S = 0.2  # how often the owner gathers the ranks' load reports


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
        self.path = str(resolve(model))
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
        self._rank_store: dict[RankKey, int | None] = {}
        self._loads: dict[RankKey, dict] = {}
        self._closed = False
        self._connect()
        for inst in self.prefill + self.decode:
            inst.on_restart = lambda _: self._connect()
        self._loads_thread = threading.Thread(target=self._gather_loads, daemon=True, name=f"loads-{tag}")
        self._loads_thread.start()
        self.client = DeploymentClient(self, self.tokenizer, name=f"dep-{tag}")

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
                for rank, meta in enumerate(inst.kv_metadata()):
                    k = self._store_of(next(index))
                    inbox = self._call_store(k, "add_writer", meta) if k is not None else None
                    links.append((store_meta[k], inbox) if inbox is not None else None)
                    self._rank_store[(inst.name, rank)] = k if inbox is not None else None
                peers = list(store_meta.values()) + (decode_meta if role == "prefill" else [])
                inst.kv_connect(peers, links)

    def _call_store(self, k: int, method: str, *args):
        """A KV store call; None (and the store counted dead) if the store is gone."""
        try:
            return ray.get(getattr(self.stores[k], method).remote(*args))
        except ray.exceptions.RayActorError:
            self.dead_stores.add(k)
            return None

    # ---- what clients need (`DeploymentOwner`) --------------------------------------------------------
    def view(self) -> dict:
        """The instances (name, DP ranks, shape) by role, the KV stores, which store each DP rank writes
        to, and the checkpoint directory: what a `DeploymentClient` is built from."""
        return {"decode": [(i.name, i.dep, f"{i.shape} instance {i.name!r}") for i in self.decode],
                "prefill": [(i.name, i.dep, f"{i.shape} instance {i.name!r}") for i in self.prefill],
                "stores": list(self.stores), "rank_store": dict(self._rank_store), "path": self.path}

    def _instance(self, name: str) -> Instance:
        return next(i for i in self.prefill + self.decode if i.name == name)

    def members_of(self, name: str) -> tuple[int, list]:
        """Instance `name`'s current gang: (generation, member handles)."""
        return self._instance(name).members_of()

    def gang_failed(self, name: str, generation: int, why: str) -> str:
        """A client found gang `generation` of instance `name` failed: restart it unless done; why it failed."""
        return self._instance(name).gang_failed(name, generation, why)

    def loads(self) -> dict[RankKey, dict]:
        """The DP ranks' latest load reports, gathered every `LOAD_PERIOD_S`."""
        return self._loads

    def _gather_loads(self) -> None:
        while not self._closed:
            members = [(inst.name, rank, m) for inst in self.prefill + self.decode
                       for rank, m in enumerate(inst.members_of()[1][:inst.dep])]
            refs = [m.load.remote() for *_, m in members]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=1.0)
            loads = dict(self._loads)
            for (name, rank, _), ref in zip(members, refs, strict=True):
                if ref in ready:
                    try:
                        loads[(name, rank)] = ray.get(ref)
                    except ray.exceptions.RayError:  # a failed gang: its clients restart it
                        loads.pop((name, rank), None)
            self._loads = loads
            time.sleep(LOAD_PERIOD_S)

    # ---- requests (through the deployment's own client) -----------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, session: str | None = None) -> str:
        """See `DeploymentClient.submit`."""
        return self.client.submit(prompt, params, session)

    def stream(self, request_id: str) -> Iterator[RequestOutput]:
        """See `DeploymentClient.stream`."""
        return self.client.stream(request_id)

    def astream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """See `DeploymentClient.astream`."""
        return self.client.astream(request_id)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 sessions: list[str | None] | None = None) -> list[Completion]:
        """See `DeploymentClient.generate`."""
        return self.client.generate(prompts, params, sessions)

    def stats(self) -> dict:
        """Every instance's stats and every live KV store's."""
        stores = [self._call_store(k, "stats") for k in range(len(self.stores))]
        return {"prefill": [i.stats() for i in self.prefill], "decode": [i.stats() for i in self.decode],
                "kv_stores": stores}

    def shutdown(self) -> None:
        self._closed = True
        # the load thread must be out of Ray before we return: a driver that disconnects from Ray while a
        # thread of it is inside a Ray call exits the process ("core worker has already been shutdown")
        self._loads_thread.join()
        self.client.close()
        for inst in self.prefill + self.decode:
            inst.shutdown()
        for store in self.stores:
            ray.kill(store)
