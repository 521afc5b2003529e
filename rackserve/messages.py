"""What the processes of a deployment say to each other over Ray: one frozen dataclass per kind.

    client -> DP rank            Submit          a request (`DPRank.submit`; `DPRank.reserve` for a push here)
    DP rank -> owner -> client   RankLoad        what a rank holds, for routers (`DPRank.load`, `Deployment.loads`)
    DP rank, KV store -> owner   BlockDelta      the blocks a cache stored and evicted (in `RankLoad`, `KVStore.block_events`)
    owner -> client              BlockFeed       every cache's deltas since what the client saw (`Deployment.block_feed`)
    gang member -> its owner     MemberPing      liveness and whereabouts (`GangMember.ping`)
    owner -> client              DeploymentView  the instances, KV stores and checkpoint a client is built from
    data plane -> ingress        ModelInfo       the model's limits (`Controller.info`)
                                 Inflight        the ingress replicas' requests in progress (`Controller.inflight`)

The transfer types travel as they are (`KVReservation`, `RemoteRegion`, a KV store's `StoreHit`),
as do `SamplingParams` and `RequestOutput`. Ray's serializer is the one codec of these calls: no
dicts with agreed keys, no `to_wire`/`from_wire` lists. (The notifications ranks and stores send each
other over NIXL are `rackserve.transfer.messages`, msgpack, since they ride on transfers, not on Ray.)
Prompts are token ids everywhere here: text is tokenized once, where it comes in (the endpoint,
`LLM`, `Instance`, `Deployment`: `rackserve.models.tokenizer.prompt_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # names only: this module imports nothing, so any layer may import it
    from rackserve.engine.sampling import SamplingParams
    from rackserve.transfer.transport import KVReservation, StoreHit

RankKey = tuple[str, int]  # (instance name, DP rank): the same in every process


@dataclass(frozen=True)
class Submit:
    """One request for a DP rank. `push_to`: a decode rank's reservation: prefill only, then push the
    state there; `cached`: a prefix of the prompt in a KV store (where to READ it, where to resume);
    `resumed`: per choice, the output it generated before (a replay, see `Engine.add_request`);
    `consumer`: who polls for its outputs (none for a pushed request: its decode rank streams it)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    push_to: KVReservation | None = None
    cached: StoreHit | None = None
    resumed: dict[int, list[int]] | None = None
    consumer: str = ""


@dataclass(frozen=True)
class BlockDelta:
    """The full blocks a cache stored and evicted since its reader last asked, as keys
    (`rackserve.engine.block_events.block_key`); `seq`: the event number to ask from next; `reset`:
    `stored` is every block it holds (a new reader, or one too far behind), forget what it had."""

    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    seq: int = 0
    reset: bool = False


@dataclass(frozen=True)
class BlockFeed:
    """What a router's prefix index applies (`rackserve.cluster.prefix_index.IndexReplica`): the
    deltas of each cache (its index in the deployment's cache list) in the order the owner took them,
    up to feed number `seq`; or, to a router too far behind, `dump`: the owner's whole index
    (`PrefixIndex.dump`)."""

    seq: int
    deltas: tuple[tuple[int, BlockDelta], ...] = ()
    dump: tuple | None = None


@dataclass(frozen=True)
class RankLoad:
    """What a router weighs (`Engine.load`): requests held (running, waiting, state on its way in),
    tokens of state they hold or will, prompt tokens still to prefill, the blocks its prefix cache has
    room for; `blocks`: what that cache stored and evicted since the owner last asked (taken off by the
    owner before clients see the load); `generation`: the gang that reported it (stamped by the owner;
    -1 before)."""

    requests: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    cache_blocks: int = 0
    blocks: BlockDelta | None = None
    generation: int = -1


@dataclass(frozen=True)
class MemberPing:
    """A gang member's answer to a ping: who it is, its process, the labels of its node (rack, tray),
    the CPU seconds it used, and the error its step loop stopped on (None while it runs)."""

    role: str
    rank: int
    pid: int
    labels: dict[str, str]
    cpu_s: float
    error: str | None = None


@dataclass(frozen=True)
class InstanceView:
    """One instance as a client sees it: its name, DP ranks, and what it is (for messages)."""

    name: str
    dep: int
    shape: str


@dataclass(frozen=True)
class DeploymentView:
    """What a `DeploymentClient` is built from: the instances by role, the KV store actors, which store
    each DP rank writes to (an index into `stores`, None: none), the checkpoint directory, the ranks'
    block size (tokens) and how requests are routed (`RoutingConfig`'s fields)."""

    decode: tuple[InstanceView, ...]
    prefill: tuple[InstanceView, ...]
    stores: tuple[Any, ...]  # KVStore actor handles
    rank_store: dict[RankKey, int | None] = field(default_factory=dict)
    path: Path | None = None
    block_size: int = 0
    routing: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelInfo:
    """The served model's limits: vocabulary size, the context every rank takes (tokens), the
    checkpoint directory."""

    vocab_size: int
    max_model_len: int
    path: Path


@dataclass(frozen=True)
class Inflight:
    """The ingress replicas heard from lately: requests they have in progress, how many replicas, and
    how many of those still took new requests when they counted."""

    requests: int
    replicas: int
    admitting: int
