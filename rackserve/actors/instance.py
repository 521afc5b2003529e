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

Requests and outputs go through an `InstanceClient` (`rackserve.actors.instance_client`): the
instance keeps one for its own Python API, and hands its gang's handles to other clients (ingress
replicas) through `members_of`; outputs stream straight from a rank to the client that submitted.

Faults: a member that dies or stops answering fails the gang (survivors notice at their next
exchange, within `timeout`); every request in flight ends with an `InstanceError` naming the member,
and the instance restarts its gang (once, whichever client saw the failure first), so the next
requests are served.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import ray
import torch
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rackserve.actors.dp_rank import DPRank
from rackserve.actors.expert_rank import ExpertRank
from rackserve.actors.gang_member import GangSpec
from rackserve.actors.instance_client import InstanceClient, InstanceError
from rackserve.collective import RendezvousServer
from rackserve.config import ConfigError, EngineConfig
from rackserve.engine import SamplingParams
from rackserve.models import read_config, resolve
from rackserve.placement import planner, rebalance

PING_TIMEOUT_S = 5.0  # a member that does not answer a ping this long after a failure counts as stalled


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
        self.path = str(resolve(model))
        if not (Path(self.path) / "config.json").is_file():
            raise ConfigError(f"model={str(model)!r}: no config.json in {self.path}; pass a checkpoint directory "
                              "(config.json + *.safetensors) or 'tiny' for the built-in tiny model")
        config = read_config(self.path)
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
        self._layout = torch.as_tensor(rebalance(torch.ones(config.num_moe_layers, config.n_routed_experts),
                                                 num_slots=holders * self.slots_per_rank,
                                                 num_ranks=holders).phy2log).tolist()
        self._lock = threading.RLock()  # the gang (generation, members); a restart holds it for seconds
        self._failures: dict[int, str] = {}  # gang generation -> why it failed
        self.generation = -1
        self.on_restart = None  # called with the instance after its gang restarted (e.g. to reconnect KV peers)
        self._kv = kv
        self._start()
        self.client = InstanceClient(self.name, dep, self, self.shape + f" instance {self.name!r}")

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
        try:
            store_at = ray.get(self.members[0].endpoint.remote(self.timeout))
            holders = (self.dep, self.world) if self.num_expert_ranks else (0, self.dep)
            spec = GangSpec(self.path, self._engine_kwargs, self._layout, self.slots_per_rank, holders,
                            tuple(store_at), self._server.address, secret, self.timeout,
                            kv_name=f"{self.name}-{secret[:8]}" if self._kv else None)
            ray.get([m.setup.remote(spec) for m in self.members])
        except BaseException:
            self._kill()  # a gang that did not start holds no actors (nor their resources) either
            raise

    def _actor(self, i: int):
        cls = DPRank if i < self.dep else ExpertRank
        # threads: a long-poll per client with requests on the rank (at most one per ingress replica;
        # ~128 on a busy decode rank of the GB300 config), submits and wakes besides
        options = {"num_cpus": 0, "max_concurrency": 192, **self._actor_options}
        if self._placement_group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(self._placement_group,
                                                                              placement_group_bundle_index=i)
        return ray.remote(cls).options(**options)

    def _member_name(self, i: int) -> str:
        return f"DP rank {i}" if i < self.dep else f"expert rank {i}"

    def members_of(self, name: str | None = None) -> tuple[int, list]:
        """The current gang: (generation, member handles) (`GangOwner`)."""
        with self._lock:
            return self.generation, list(self.members)

    def gang_failed(self, name: str | None, generation: int, why: str) -> str:
        """A client found gang `generation` failed (`GangOwner`): see `_fail`."""
        return self._fail(generation, why)

    def _fail(self, generation: int, cause: BaseException | str) -> str:
        """Record why gang `generation` failed (naming the members at fault) and restart it, once
        however many threads or clients find it failed; returns the reason."""
        with self._lock:
            if generation == self.generation:
                self._failures[generation] = self._diagnose(cause)
                self._restart()
            return self._failures.get(generation, f"{self.shape} instance {self.name!r} restarted its gang")

    def _diagnose(self, cause: BaseException | str) -> str:
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
        detail = "; ".join(culprits) if culprits else (errors[0] if errors else cause if isinstance(cause, str)
                                                        else f"{type(cause).__name__}: {cause}")
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

    # ---- requests (through the instance's own client) ----------------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
               rank: int | None = None, push_to: list | None = None, cached: tuple[int, list] | None = None) -> str:
        """See `InstanceClient.submit`."""
        return self.client.submit(prompt, params, request_id, rank, push_to, cached)

    def reserve(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                rank: int | None = None) -> tuple[str, list | None]:
        """See `InstanceClient.reserve`."""
        return self.client.reserve(prompt, params, request_id, rank)

    def stream(self, request_id: str) -> Iterator[dict]:
        """See `InstanceClient.stream`."""
        return self.client.stream(request_id)

    def astream(self, request_id: str) -> AsyncIterator[dict]:
        """See `InstanceClient.astream`."""
        return self.client.astream(request_id)

    def abort(self, request_id: str, rank: int | None = None) -> None:
        """See `InstanceClient.abort`."""
        self.client.abort(request_id, rank)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | None = None) -> list[dict]:
        """See `InstanceClient.generate`."""
        return self.client.generate(prompts, params)

    def kv_metadata(self) -> list[bytes]:
        """The NIXL agent metadata of every DP rank (an instance made with `kv=True`)."""
        return ray.get([m.kv_metadata.remote() for m in self.members[:self.dep]])

    def kv_connect(self, peers: list[bytes], stores: list[tuple[bytes, list] | None] | None = None) -> None:
        """Every DP rank learns `peers`; DP rank i writes prefixes to `stores[i]` (metadata, inbox)."""
        stores = stores or [None] * self.dep
        ray.get([m.kv_connect.remote(peers, store) for m, store in zip(self.members[:self.dep], stores, strict=True)])

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
            self.client.close()  # first: the output pumps then end with their members, restarting nothing
            for member in self.members:
                try:
                    ray.get(member.shutdown.remote())
                except ray.exceptions.RayActorError:
                    pass
            self._kill()
            self.client.end_streams(self.generation, None, f"{self.shape} instance {self.name!r} was shut down")
