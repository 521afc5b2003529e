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

The gang's life (start, restart, shutdown) is a `GangSupervisor`'s. Requests and outputs go through
an `InstanceClient` (`rackserve.cluster.instance_client`): the instance keeps one for its own Python
API, and hands its gang's handles to other clients (ingress replicas) through `members_of`; outputs
stream straight from a rank to the client that submitted.

Faults: a member that dies or stops answering fails the gang (survivors notice at their next
exchange, within `timeout`); every request in flight ends with an `InstanceError` naming the member
(`rackserve.cluster.faults`), and the instance restarts its gang (once, whichever client saw the
failure first), so the next requests are served.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import ray
import torch
from ray.util.placement_group import PlacementGroup

from rackserve.actors.gang_member import GangSpec
from rackserve.cluster.faults import retry_after_restart
from rackserve.cluster.gang_supervisor import GangSupervisor
from rackserve.cluster.instance_client import InstanceClient
from rackserve.config import ConfigError, EngineConfig
from rackserve.engine import Completion, RequestOutput, SamplingParams
from rackserve.messages import MemberPing
from rackserve.models import read_config, resolve
from rackserve.models.tokenizer import Tokenizer, prompt_ids
from rackserve.placement import planner, rebalance
from rackserve.transfer.transport import KVReservation, RemoteRegion, StoreHit


class Instance:
    def __init__(self, model: str | Path = "tiny", dep: int = 2, expert_ranks: int = 0, redundant_slots: int = 0,
                 engine_kwargs: dict | None = None, actor_options: dict | None = None, timeout: float = 30.0,
                 placement_group: PlacementGroup | None = None, name: str = "instance", kv: bool = False,
                 replace_placement: Callable[[], PlacementGroup] | None = None):
        """`dep` DP ranks; `expert_ranks` > 0: attention–FFN split mode with that many expert
        ranks; `redundant_slots`: extra expert slots (replicas) over the instance; `engine_kwargs`:
        `EngineConfig` fields of every rank; `actor_options`: Ray options of every member; with a
        `placement_group` (one bundle per member, as `placement.ray_groups` makes them) member i runs
        in bundle i; `timeout` (s): a member silent this long fails the gang; `kv`: give every DP
        rank a NIXL agent, for disaggregated prefill/decode (see `Deployment`); `replace_placement`: a new,
        placed group when the group lost a node (see `GangSupervisor`)."""
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
        self.slots_per_rank = -(-(max(config.expert_counts) + redundant_slots) // holders)
        self.dep, self.num_expert_ranks, self.world = dep, expert_ranks, dep + expert_ranks
        if placement_group is not None and placement_group.bundle_count < self.world:
            raise ConfigError(f"the placement group has {placement_group.bundle_count} bundles; this instance needs "
                              f"one per member ({dep} DP + {expert_ranks} expert ranks = {self.world})")
        self.shape = f"DEP{dep}" if not expert_ranks else f"AFD{dep}+{expert_ranks}"
        self.name, self.timeout = name, timeout
        self._engine_kwargs, self._kv = dict(engine_kwargs or {}), kv
        # a balanced layout for each run of layers with as many experts; a draft model with fewer experts than
        # a rank's slots (V4.1-Flash's 128 on fewer than 3 ranks) holds all of them on every rank, in turn
        self._layout = []
        num_slots = holders * self.slots_per_rank
        for experts, run in itertools.groupby(config.expert_counts):
            run = list(run)
            if experts < self.slots_per_rank:
                self._layout += [[slot % experts for slot in range(num_slots)]] * len(run)
                continue
            layout = rebalance(torch.ones(len(run), experts), num_slots=num_slots, num_ranks=holders)
            self._layout += torch.as_tensor(layout.phy2log).tolist()
        self.on_restart = None  # called with the instance after its gang restarted (e.g. to reconnect KV peers)
        label = f"{self.shape} instance {self.name!r}"
        self._gang = GangSupervisor(label, dep, self.world, self._spec, timeout, actor_options, placement_group,
                                    on_restart=self._restarted, replace_placement=replace_placement)
        self.client = InstanceClient(self.name, dep, self, label)

    @classmethod
    def from_plan(cls, planned: planner.PlannedInstance, placement_group: PlacementGroup, model: str | Path = "tiny",
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
    def _spec(self, store_at: tuple[str, int], rendezvous_at: tuple[str, int], secret: str) -> GangSpec:
        holders = (self.dep, self.world) if self.num_expert_ranks else (0, self.dep)
        return GangSpec(self.path, self._engine_kwargs, self._layout, self.slots_per_rank, holders, store_at,
                        rendezvous_at, secret, self.timeout, kv_name=f"{self.name}-{secret[:8]}" if self._kv else None)

    def _restarted(self) -> None:
        if self.on_restart is not None:
            self.on_restart(self)

    @property
    def generation(self) -> int:
        """The current gang's generation: gang restarts so far."""
        return self._gang.generation

    @property
    def restarting(self) -> bool:
        """Whether its gang is being replaced right now."""
        return self._gang.restarting

    @property
    def down(self) -> str | None:
        """Why its gang is not running (its last start failed: e.g. no room to place it), else None."""
        return self._gang.down

    @property
    def placement_group(self) -> PlacementGroup | None:
        """The placement group its gang runs in (a new one after a lost node was re-planned)."""
        return self._gang.placement_group()

    @property
    def members(self) -> list:
        """The current gang's member handles: DP ranks, then expert ranks."""
        return self._gang.members

    def members_of(self, name: str | None = None) -> tuple[int, list]:
        """The current gang: (generation, member handles) (`GangOwner`)."""
        return self._gang.current()

    def gang_failed(self, name: str | None, generation: int, why: str) -> str:
        """A client found gang `generation` failed (`GangOwner`): see `GangSupervisor.fail`."""
        return self._gang.fail(generation, why)

    def gang_failure(self, name: str | None, generation: int, why: str) -> str:
        """Why gang `generation` failed, restarting nothing (`GangOwner`): see `GangSupervisor.reason`."""
        return self._gang.reason(generation, why)

    # ---- requests (through the instance's own client) ----------------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
               rank: int | None = None, push_to: KVReservation | None = None,
               cached: StoreHit | None = None) -> str:
        """See `InstanceClient.submit`; text is tokenized here."""
        return self.client.submit(prompt_ids(self.tokenizer, prompt), params, request_id, rank, push_to, cached)

    def reserve(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                rank: int | None = None) -> tuple[str, KVReservation | None]:
        """See `InstanceClient.reserve`; text is tokenized here."""
        return self.client.reserve(prompt_ids(self.tokenizer, prompt), params, request_id, rank)

    def stream(self, request_id: str) -> Iterator[RequestOutput]:
        """See `InstanceClient.stream`."""
        return self.client.stream(request_id)

    def astream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """See `InstanceClient.astream`."""
        return self.client.astream(request_id)

    def abort(self, request_id: str, rank: int | None = None) -> None:
        """See `InstanceClient.abort`."""
        self.client.abort(request_id, rank)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | None = None) -> list[Completion]:
        """Run prompts to completion across the ranks; their completions, in order (a prompt's n choices
        one after another; input the engine refused ends with its `error`). Text is tokenized here."""
        params = params or SamplingParams()
        prompts = [prompt_ids(self.tokenizer, p) for p in prompts]
        ids = [self.client.submit(p, params) for p in prompts]
        return [c for request_id, p in zip(ids, prompts, strict=True)
                for c in Completion.from_outputs(request_id, p, self.client.stream(request_id),
                                                 logprobs=params.logprobs is not None)]

    @functools.cached_property
    def tokenizer(self) -> Tokenizer | None:
        """The checkpoint's tokenizer (None without tokenizer.json), loaded when text first comes in."""
        return Tokenizer(self.path) if (Path(self.path) / "tokenizer.json").is_file() else None

    def kv_metadata(self) -> list[tuple[str, bytes]]:
        """(NIXL agent name, metadata) of every DP rank (an instance made with `kv=True`)."""
        return ray.get([m.kv_metadata.remote() for m in self.members[:self.dep]])

    def kv_connect(self, peers: list[bytes], stores: list[tuple[bytes, RemoteRegion] | None] | None = None,
                   forget: list[str] = ()) -> None:
        """Every DP rank forgets the agents `forget` (gone) and learns `peers`; DP rank i writes
        prefixes to `stores[i]` (metadata, inbox), if given."""
        stores = stores or [None] * self.dep
        ray.get([m.kv_connect.remote(peers, store, list(forget))
                 for m, store in zip(self.members[:self.dep], stores, strict=True)])

    def stats(self) -> dict:
        """The instance's shape, gang restarts so far, and every member's counters."""
        # a gang found dead here is restarted, and the fresh gang's counters reported
        counters = retry_after_restart(self._gang.current, lambda members: ray.get([m.stats.remote() for m in members]),
                                       self._gang.fail)
        return {"name": self.name, "shape": self.shape, "restarts": self.generation,
                "failures": self._gang.failures, "members": counters}

    def ping(self) -> list[MemberPing]:
        """Every member's liveness and whereabouts (see `GangMember.ping`)."""
        return ray.get([m.ping.remote() for m in self.members])

    def shutdown(self) -> None:
        """Stop every member (one that already died is skipped) and release them; a stream still
        open ends with an `InstanceError`."""
        self.client.close()  # first: the output pumps then end with their members, restarting nothing
        generation = self._gang.shutdown()
        self.client.end_streams(generation, None, f"{self.shape} instance {self.name!r} was shut down")
