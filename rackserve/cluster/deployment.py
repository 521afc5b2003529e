"""`Deployment`: prefill instances, decode instances and KV stores from one spec, driven from Python.

    dep = Deployment("tiny", prefill="1xDEP1", decode="1xDEP2", kv_stores=1)
    [c] = dep.generate(["The rack hums"], SamplingParams(max_tokens=8, temperature=0))
    for out in dep.stream(dep.submit("…", params, session="chat-7")): ...
    dep.shutdown()

The deployment *owns* the data plane: it creates the instances and KV stores, introduces their NIXL
agents, restarts a failed gang (once, whoever finds it: a client, or its own watcher, which looks
every `TIMEOUTS.watch_s`) and rewires it (the agents that knew the dead ranks forget them), replaces a dead
KV store by an empty one, and gathers the ranks' load reports every `TIMEOUTS.load_period_s`. Requests go
through a `DeploymentClient` (routing, the P/D path, streaming, replay: see
`rackserve.cluster.deployment_client`): the deployment keeps one for its own Python API,
and any other process (an ingress replica) can make its own from `view()`, `members_of`,
`gang_failed`, `loads` and `block_feed`, which is what the serving data plane exposes
(`rackserve.serve.controller`). Every rank's and store's block events are gathered with the loads into
one journal (`BlockJournal`) that every client's router follows (`block_feed`), so routers know what
each cache holds without asking it.
Each decode rank writes prompt + answer back to its KV store when a request finishes, so the next
turn of a session prefills only its new text.
"""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group

from rackserve.actors.kv_store import KVStore
from rackserve.cluster.deployment_client import DeploymentClient
from rackserve.cluster.faults import GANG_ERRORS, InstanceError, UnplacedError, member_name
from rackserve.cluster.instance import Instance
from rackserve.cluster.prefix_index import BlockJournal
from rackserve.cluster.request_router import RoutingConfig
from rackserve.config import ConfigError, EngineConfig
from rackserve.engine import Completion, RequestOutput, SamplingParams
from rackserve.messages import BlockFeed, DeploymentView, InstanceView, RankKey, RankLoad
from rackserve.models import read_config, resolve
from rackserve.models.tokenizer import Tokenizer
from rackserve.placement import InstanceGroup, PlacementError, TopologyError
from rackserve.placement import plan as plan_instances
from rackserve.placement.planner import NO_PREFILL, Plan
from rackserve.placement.ray_groups import alive_trays, kv_store_options, live_topology, placement_group_of
from rackserve.timeouts import TIMEOUTS
from rackserve.transfer.transport import RemoteRegion

log = logging.getLogger(__name__)


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
                 prefill_engine_kwargs: dict | None = None, decode_engine_kwargs: dict | None = None,
                 routing: RoutingConfig | None = None, store_disk_mb: float = 0.0, store_disk_path: str | None = None):
        """`prefill` / `decode`: instance shapes as the planner writes them ("2xDEP2", "DEP4",
        "AFD2+2"); `prefill="none"`: no prefill instances, each decode rank prefilling the requests it
        serves (one machine, where disaggregation cannot pay); `kv_stores`: KV-store actors (0: none);
        `engine_kwargs`: `EngineConfig` fields of every rank, with `prefill_engine_kwargs` /
        `decode_engine_kwargs` on top for one role (the state layout, i.e. block size and dtype, must
        match across roles); `decode_redundant_slots`:
        extra expert slots (EPLB replicas) per decode instance. With a `plan` (`placement.plan`) and
        its `placement_groups` (`placement.ray_groups`, made with `bundle_resources`), the instances
        and KV stores are the plan's, each rank and store where the plan put it; `prefill`, `decode`
        and `kv_stores` are then the plan's too. An instance whose group loses a node is re-planned
        onto free GPUs (`_replan`): the deployment then holds its new group (`placement_groups`).
        `routing`: how clients route requests (`RoutingConfig`; its `index_entries` bounds the owner's
        block index too). `store_disk_mb`: each KV store's local-disk tier (`DiskTier`) under
        `store_disk_path` (default: the temporary directory of the store's node), none at 0."""
        groups = [InstanceGroup.parse(decode, "decode")] + (
            [] if prefill == NO_PREFILL else [InstanceGroup.parse(prefill, "prefill")])
        if plan is None and any(g.count < 1 for g in groups):
            raise ConfigError(f"prefill={prefill!r}, decode={decode!r}: a deployment needs at least one decode "
                              f"instance, and a prefill instance unless prefill={NO_PREFILL!r} (the decode "
                              "instances then prefill their own requests)")
        if plan is None and kv_stores < 0:
            raise ConfigError(f"kv_stores={kv_stores} must be ≥ 0")
        self.path = str(resolve(model))
        self.routing = routing or RoutingConfig()
        self.tokenizer = Tokenizer(self.path) if (Path(self.path) / "tokenizer.json").is_file() else None
        engine_kwargs = dict(engine_kwargs or {})
        tag = secrets.token_hex(3)
        prefill_kwargs, decode_kwargs = _role_engine_kwargs(engine_kwargs, prefill_engine_kwargs, decode_engine_kwargs)
        self.block_size = EngineConfig(**decode_kwargs).resolve(read_config(self.path)).block_size
        # the stores hold the state layout the ranks write (with the MTP layer when decode speculates)
        store_kwargs = {**engine_kwargs, "speculative_tokens": prefill_kwargs.get("speculative_tokens", 0)}
        role_kwargs = {"prefill": {"engine_kwargs": prefill_kwargs},
                       "decode": {"engine_kwargs": decode_kwargs, "redundant_slots": decode_redundant_slots}}
        common = {"timeout": timeout, "kv": True}

        def new_store(i: int, options: dict):
            options = {"num_cpus": 0, "max_concurrency": 8, **options}
            return ray.remote(KVStore).options(**options).remote(self.path, store_memory_mb,
                                                                 engine_kwargs=store_kwargs, name=f"kvstore{i}-{tag}",
                                                                 disk_mb=store_disk_mb, disk_path=store_disk_path)

        self.plan, self.placement_groups = plan, dict(placement_groups or {})
        self._bundle_resources = bundle_resources
        self._placing = threading.Lock()  # one re-plan at a time
        if plan is None:
            self._store_options = [{}] * kv_stores
            makers = [(g.role, functools.partial(Instance, self.path, dep=g.size, expert_ranks=g.expert_ranks,
                                                 name=f"{g.role}{i}-{tag}", **common, **role_kwargs[g.role]))
                      for g in groups for i in range(g.count)]
            self.stores = [new_store(i, options) for i, options in enumerate(self._store_options)]
        else:
            if not {"prefill", "decode"} <= {p.role for p in plan.instances}:
                raise ConfigError("the plan needs at least one prefill and one decode instance")
            makers = [(p.role, functools.partial(Instance.from_plan, p, placement_groups[p.name], self.path,
                                                 bundle_resources, **common, **role_kwargs[p.role],
                                                 replace_placement=functools.partial(self._replan, p.name)))
                      for p in plan.instances]
            self._store_options = [kv_store_options(s, num_cpus=0) for s in plan.kv_stores]
            self.stores = [new_store(i, options) for i, options in enumerate(self._store_options)]
        self._new_store = new_store
        try:
            started = _start_together([make for _, make in makers])
        except BaseException:
            for store in self.stores:
                ray.kill(store)
            raise
        self.decode, self.prefill = ([inst for (r, _), inst in zip(makers, started, strict=True) if r == role]
                                     for role in ("decode", "prefill"))
        self.dead_stores: set[int] = set()
        self._store_pings: dict[int, tuple[ray.ObjectRef, float]] = {}  # store -> its ping out, sent when (monotonic)
        self.stores_replaced = 0
        self._rank_store: dict[RankKey, int | None] = {}
        self._agents: dict[RankKey, tuple[str, bytes]] = {}  # each DP rank's NIXL agent: (name, metadata)
        self._store_agents: dict[int, tuple[str, bytes]] = {}  # each live KV store's
        self._wiring = threading.RLock()  # one rewiring at a time (restarts and store replacements)
        self._loads: dict[RankKey, RankLoad] = {}
        # every cache numbered once (`rackserve.cluster.prefix_index`): DP ranks, decode then prefill, then stores
        ranks = [(i.name, r) for i in self.decode + self.prefill for r in range(i.dep)]
        self._cache_of = {key: n for n, key in enumerate(ranks)}
        self.blocks = BlockJournal(len(ranks) + len(self.stores), self.routing.index_entries, ranks=len(ranks))
        self._closed = False
        self._connect()
        for inst in self.prefill + self.decode:
            inst.on_restart = self._connect
        self._threads = [threading.Thread(target=self._gather_loads, daemon=True, name=f"loads-{tag}"),
                         threading.Thread(target=self._watch, daemon=True, name=f"watch-{tag}")]
        for thread in self._threads:
            thread.start()
        self.client = DeploymentClient(self, self.tokenizer, name=f"dep-{tag}")

    # ---- wiring --------------------------------------------------------------------------------------
    def _store_of(self, index: int) -> int | None:
        """The KV store of the `index`-th rank (round robin over the live stores)."""
        live = [i for i in range(len(self.stores)) if i not in self.dead_stores]
        return live[index % len(live)] if live else None

    def _connect(self, restarted: Instance | None = None) -> None:
        """Introduce the ranks' agents to the agents they talk to: prefill ranks to every decode rank
        and KV store, every rank to its KV store (with an inbox there). At start, every rank. After the
        gang of `restarted` was replaced: its fresh ranks as at start, while whoever knew its old agents
        (the KV stores; the prefill ranks, for a decode instance) forgets them and learns the new ones,
        so that no NIXL connection, store inbox or peer entry of a dead process is left behind."""
        with self._wiring:
            self._refresh_store_agents()
            fresh = [restarted] if restarted is not None else self.prefill + self.decode
            gone = [self._agents.pop((restarted.name, r))[0] for r in range(restarted.dep)
                    if (restarted.name, r) in self._agents] if restarted is not None else []
            for inst in fresh:
                for rank, agent in enumerate(inst.kv_metadata()):
                    self._agents[(inst.name, rank)] = agent
            if gone:
                for k in list(self._store_agents):
                    self._call_store(k, "remove_writers", gone)
            stores = [meta for _, meta in self._store_agents.values()]
            for inst in fresh:
                links = [self._link((inst.name, rank)) for rank in range(inst.dep)]
                inst.kv_connect(stores + (self._decode_agents() if inst in self.prefill else []), links)
            if restarted is not None and restarted in self.decode:
                new = [self._agents[(restarted.name, r)][1] for r in range(restarted.dep)]
                for inst in self.prefill:
                    try:
                        inst.kv_connect(new, forget=gone)
                    except GANG_ERRORS:  # a failed prefill gang: its own restart wires it to every decode rank
                        log.warning("prefill instance %r did not learn the restarted %r", inst.name, restarted.name)

    def _decode_agents(self) -> list[bytes]:
        return [meta for (name, _), (_, meta) in self._agents.items() if name in {i.name for i in self.decode}]

    def _refresh_store_agents(self, timeout: float | None = None) -> None:
        """Learn the agents of the KV stores not yet known, waiting up to `timeout` s for each (a store
        not started by then is tried again later); a store found dead is counted so (call under `_wiring`)."""
        for k, store in enumerate(self.stores):
            if k not in self._store_agents and k not in self.dead_stores:
                try:
                    self._store_agents[k] = tuple(ray.get(store.metadata.remote(), timeout=timeout))
                except ray.exceptions.RayActorError:
                    self.dead_stores.add(k)
                except ray.exceptions.GetTimeoutError:
                    log.warning("KV store %d has not started after %.0f s; trying again later", k, timeout)

    def _link(self, key: RankKey) -> tuple[bytes, RemoteRegion] | None:
        """The KV store DP rank `key` writes to (the one it had, while it lives; else round robin over
        the live stores) as (its metadata, the rank's inbox there), recorded in `_rank_store`; None
        without a live store (call under `_wiring`)."""
        k = self._rank_store.get(key)
        if k is None or k in self.dead_stores:
            keys = [(i.name, r) for i in self.decode + self.prefill for r in range(i.dep)]
            k = self._store_of(keys.index(key))
        inbox = self._call_store(k, "add_writer", self._agents[key][1]) if k is not None else None
        self._rank_store[key] = k if inbox is not None else None
        return (self._store_agents[k][1], inbox) if inbox is not None else None

    def replace_dead_stores(self) -> list[int]:
        """Replace every KV store that died, or that answered no ping for `TIMEOUTS.store_stall_s` (stalled),
        by a fresh, empty one (same place, same index), and attach to it the ranks that wrote to it; every
        rank forgets the old store's agent and learns the new one. Its cached prefixes are lost, never
        requests. The indices replaced."""
        with self._wiring:
            now = time.monotonic()
            for k, store in enumerate(self.stores):  # a ping not answered yet stays out: its age tells a stall
                if k not in self.dead_stores and k not in self._store_pings:
                    self._store_pings[k] = (store.ping.remote(), now)
            refs = [ref for ref, _ in self._store_pings.values()]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=TIMEOUTS.store_ping_s)
            for k, (ref, sent) in list(self._store_pings.items()):
                if ref in ready:
                    del self._store_pings[k]
                    try:
                        ray.get(ref)
                    except ray.exceptions.RayActorError:
                        self.dead_stores.add(k)
                elif now - sent > TIMEOUTS.store_stall_s:
                    log.warning("KV store %d has answered no ping for %.0f s (its process stopped or its host "
                                "stalled): replacing it; its cached prefixes are lost", k, now - sent)
                    self.dead_stores.add(k)
            replaced = sorted(self.dead_stores)
            alive = alive_trays() if replaced and self.plan is not None else None
            for k in replaced:
                self._store_pings.pop(k, None)
                ray.kill(self.stores[k])
                if alive is not None:  # its tray's node may be gone with it: then near it, or anywhere
                    self._store_options[k] = kv_store_options(self.plan.kv_stores[k], num_cpus=0, alive=alive)
                self.stores[k] = self._new_store(k, self._store_options[k])
                gone = self._store_agents.pop(k, None)
                self.dead_stores.discard(k)
                self._refresh_store_agents(timeout=TIMEOUTS.gang_start_s)
                if k not in self._store_agents:  # the replacement did not start either: try again later
                    continue
                self.stores_replaced += 1
                for inst in self.prefill + self.decode:
                    links = [self._link((inst.name, r)) if self._rank_store.get((inst.name, r)) in (k, None) else None
                             for r in range(inst.dep)]
                    inst.kv_connect([self._store_agents[k][1]], links, forget=[gone[0]] if gone else [])
            return replaced

    def _call_store(self, k: int, method: str, *args):
        """A KV store call; None if the store is gone (then counted dead) or gave no answer within
        `TIMEOUTS.store_call_s` (stalled: its pings tell whether it is replaced)."""
        try:
            return ray.get(getattr(self.stores[k], method).remote(*args), timeout=TIMEOUTS.store_call_s)
        except ray.exceptions.RayActorError:
            self.dead_stores.add(k)
        except ray.exceptions.GetTimeoutError:
            log.warning("KV store %d did not answer %s within %.0f s: going on without it", k, method,
                        TIMEOUTS.store_call_s)
        return None

    # ---- what clients need (`DeploymentOwner`) --------------------------------------------------------
    def view(self) -> DeploymentView:
        """What a `DeploymentClient` is built from (see `DeploymentView`)."""
        def seen(instances: list[Instance]) -> tuple[InstanceView, ...]:
            return tuple(InstanceView(i.name, i.dep, f"{i.shape} instance {i.name!r}") for i in instances)

        return DeploymentView(seen(self.decode), seen(self.prefill), tuple(self.stores), dict(self._rank_store),
                              self.path, self.block_size, asdict(self.routing))

    def _replan(self, name: str) -> PlacementGroup:
        """A new placement group (not yet placed) for instance `name`, whose group lost a node: the plan
        made again on the trays that have a node now, keeping every other instance where it is
        (`plan(previous=...)`), puts it on free GPUs; its old group is removed. Raises `UnplacedError`
        (the old group kept: Ray re-places it once a node of its tray joins) if there is no room."""
        with self._placing:
            before = self.plan.instance(name)
            try:
                placed = plan_instances(live_topology(self.plan.topology), self.plan.spec, previous=self.plan)
            except (PlacementError, TopologyError) as e:
                raise UnplacedError(f"instance {name!r} lost a node and there is no room to place it elsewhere ({e}); "
                                    f"it starts again once a node of its trays ({before.trays}) joins") from None
            after = placed.instance(name)
            remove_placement_group(self.placement_groups[name])
            group = self.placement_groups[name] = placement_group_of(after, self._bundle_resources)
            self.plan = replace(self.plan, instances=tuple(after if i.name == name else i for i in self.plan.instances))
            log.warning("instance %r lost a node: re-planned from %s to %s", name, before.trays, after.trays)
            return group

    def _instance(self, name: str) -> Instance:
        return next(i for i in self.prefill + self.decode if i.name == name)

    def members_of(self, name: str) -> tuple[int, list]:
        """Instance `name`'s current gang: (generation, member handles)."""
        return self._instance(name).members_of()

    def gang_failure(self, name: str, generation: int, why: str) -> str:
        """Why gang `generation` of instance `name` failed, restarting nothing (`GangOwner`)."""
        return self._instance(name).gang_failure(name, generation, why)

    def gang_failed(self, name: str, generation: int, why: str) -> str:
        """A client found gang `generation` of instance `name` failed: restart it unless done; why it failed."""
        return self._instance(name).gang_failed(name, generation, why)

    def loads(self) -> dict[RankKey, RankLoad]:
        """The DP ranks' latest load reports, gathered every `TIMEOUTS.load_period_s`, each with its gang's
        `generation`; a rank of a gang restarting or down, or silent for `TIMEOUTS.load_stale_s`, has none (routers
        send it nothing while another can take it)."""
        return self._loads

    def block_feed(self, since: int) -> BlockFeed:
        """The caches' block deltas after feed number `since`, for a client's router (`BlockJournal.feed`)."""
        return self.blocks.feed(since)

    def _gather_loads(self) -> None:
        """Every `TIMEOUTS.load_period_s`: each DP rank's load and each cache's block events since the
        last (a rank of a new gang, or a replaced store, from nothing: its first delta is a reset)."""
        seen: dict[RankKey, float] = {}  # when each rank last answered
        cursor: dict[RankKey, tuple[int, int]] = {}  # rank -> (its gang's generation, its next block event)
        store_cursor: dict[int, tuple[object, int]] = {}  # store index -> (its handle, its next block event)
        while not self._closed:
            members = [(inst.name, rank, generation, m) for inst in self.prefill + self.decode
                       if not (inst.restarting or inst.down)
                       for generation, gang in [inst.members_of()] for rank, m in enumerate(gang[:inst.dep])]
            refs = []
            for name, rank, generation, m in members:
                at = cursor.get((name, rank))
                refs.append(m.load.remote(at[1] if at is not None and at[0] == generation else None))
            stores = [(k, store) for k, store in enumerate(self.stores) if k not in self.dead_stores]
            store_refs = []
            for k, store in stores:
                at = store_cursor.get(k)
                store_refs.append(store.block_events.remote(at[1] if at is not None and at[0] is store else None))
            ready, _ = ray.wait(refs + store_refs, num_returns=len(refs + store_refs), timeout=1.0)
            loads, now = {}, time.monotonic()
            for (name, rank, generation, _), ref in zip(members, refs, strict=True):
                if ref in ready:
                    try:
                        load = ray.get(ref)
                    except ray.exceptions.RayError:  # a failed gang: its clients or the watcher restart it
                        continue
                    self.blocks.add(self._cache_of[(name, rank)], load.blocks)
                    cursor[(name, rank)] = (generation, load.blocks.seq)
                    loads[(name, rank)] = replace(load, blocks=None, generation=generation)
                    seen[(name, rank)] = now
                elif (name, rank) in self._loads and now - seen.get((name, rank), now) < TIMEOUTS.load_stale_s:
                    loads[(name, rank)] = self._loads[(name, rank)]  # slow to answer this time
            for (k, store), ref in zip(stores, store_refs, strict=True):
                if ref in ready:
                    try:
                        delta = ray.get(ref)
                    except ray.exceptions.RayError:  # dead: the watcher replaces it (a reset comes with the new one)
                        continue
                    self.blocks.add(len(self._cache_of) + k, delta)
                    store_cursor[k] = (store, delta.seq)
            self._loads = loads
            time.sleep(TIMEOUTS.load_period_s)

    @property
    def closed(self) -> bool:
        """Whether `shutdown` was called."""
        return self._closed

    def _watch(self) -> None:
        """Every `TIMEOUTS.watch_s`: replace dead KV stores, and restart the gangs found failed (at once: an idle
        instance's failure would otherwise wait for its next request)."""
        while not self._closed:
            time.sleep(TIMEOUTS.watch_s)
            try:
                self.replace_dead_stores()
                self.restart_failed_gangs()
            except Exception:  # noqa: BLE001 - e.g. a rank restarting meanwhile (its restart rewires it): again later
                log.exception("mending the deployment failed; trying again in %.0f s", TIMEOUTS.watch_s)

    def restart_failed_gangs(self) -> list[str]:
        """Restart every gang with a member that died or whose step loop failed (a peer lost), and every
        instance down (its last start failed); a member that is only slow to answer is left to the gang's
        own timeout. The instances restarted (an instance that could not start is logged, and tried again
        at the next call)."""
        restarted = []
        for inst in self.prefill + self.decode:
            if inst.restarting or self._closed:
                continue
            generation, members = inst.members_of()
            refs = [m.ping.remote() for m in members]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=TIMEOUTS.member_ping_s)
            for i, ref in enumerate(refs):
                try:
                    error = ray.get(ref).error if ref in ready else None
                except ray.exceptions.RayActorError:
                    error = f"{member_name(i, inst.dep)} died"
                if error:
                    was = inst.down
                    try:
                        inst.gang_failed(inst.name, generation, error)
                        restarted.append(inst.name)
                    except InstanceError as e:  # e.g. no room to place it: the next call tries again
                        if str(e) != was:
                            log.warning("%s", e)
                    break
        return restarted

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
        # the threads must be out of Ray before we return: a driver that disconnects from Ray while a
        # thread of it is inside a Ray call exits the process ("core worker has already been shutdown")
        for thread in self._threads:
            thread.join()
        self.client.close()
        for inst in self.prefill + self.decode:
            inst.shutdown()
        closing = [store.close.remote() for store in self.stores]  # a disk tier's files go with it
        ray.wait(closing, num_returns=len(closing), timeout=10)
        for store in self.stores:
            ray.kill(store)
