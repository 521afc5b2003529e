"""What every rank actor of an instance's gang has: identity, the two groups, the model, the loop.

A gang member joins the expert-parallel process group (Gloo on CPU, NCCL on CUDA) and the host
collective (`rackserve.collective`), loads the model with its share of the expert slots, and runs
`_step` in a background thread. A model with host tables (V4.1's Engram) reads them from its
node's one copy (`rackserve.actors.table_host`). Idle protocol: when a step's host sync shows no member with work,
every member blocks until woken. A member that takes in work (a request, an abort, a call on its
engine) in the first step after such an idle sync wakes every other member itself (`nudge`), so
that all of them meet it at that step's host sync: a wake from the submitting client alone can be
spent on a sync the member with the work made just *before* taking it in, leaving that member
waiting at its next sync for a peer that went back to sleep (a stall until the next request or
the gang's timeout). A failed step (a dead or silent peer) ends the loop and is kept in `error`
for the callers.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from rackserve import timing
from rackserve.actors.table_host import map_node_tables
from rackserve.collective import join
from rackserve.config import EngineConfig
from rackserve.messages import MemberPing
from rackserve.models import host_tables, load_model
from rackserve.models.interface import ServingModel
from rackserve.transfer.ep import ExpertParallel


@dataclass(frozen=True)
class GangSpec:
    """Everything a member needs to join its gang; the same for every member.

    phy2log: `[num_layers][num_slots]` the logical expert of every physical slot, a row per MoE
    layer (main layers, then MTP layers; see `ServingModel.shard_experts`); expert_ranks:
    (first, stop) the gang ranks holding slots, `slots_per_rank` each; store_at: (host, port) of rank
    0's TCP store, the expert-parallel process group's rendezvous; timeout (s): how long a
    peer may stay silent before a member gives up on the gang; kv_name: when set, DP ranks get a
    NIXL agent named `<kv_name>-r<rank>` for disaggregated prefill/decode.
    """

    checkpoint: str
    engine_kwargs: dict
    phy2log: list[list[int]]
    slots_per_rank: int
    expert_ranks: tuple[int, int]
    store_at: tuple[str, int]
    rendezvous_at: tuple[str, int]
    secret: str
    timeout: float
    kv_name: str | None = None


class GangMember:
    role = "member"
    # whether the member's forward reads the model's host tables (V4.1's Engram), from its node's one copy
    # (`rackserve.actors.table_host`); an expert rank holds only experts
    reads_host_tables = True

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self._lock = threading.Condition()
        self._wake = threading.Event()
        self._stop = False
        self.error: str | None = None
        self.gang = None
        self._store: dist.TCPStore | None = None
        self._others: list = []  # the other members' handles, to wake them
        self._gang_idle = True  # the last host sync found no member with work: the others may be asleep

    def endpoint(self, timeout: float) -> tuple[str, int]:
        """Start the expert-parallel process group's rendezvous here (rank 0 does): a TCP store on a
        port the kernel picks, held open from now on; its (host, port). Holding it matters: a port
        found free and closed again can be taken (e.g. by an outgoing connection) before it is bound."""
        host = socket.gethostbyname(socket.gethostname())
        self._store = dist.TCPStore(host, 0, self.world_size, is_master=True, timeout=timedelta(seconds=timeout),
                                    wait_for_workers=False)
        return host, self._store.port

    def _join(self, spec: GangSpec, members: list) -> tuple[ServingModel, EngineConfig]:
        """Join both groups; load the model holding (and reading) only this rank's expert slots.
        `members`: every member's handle, in rank order."""
        self._others = [m for i, m in enumerate(members) if i != self.rank]
        config = EngineConfig(**spec.engine_kwargs)
        timeout = timedelta(seconds=spec.timeout)
        store = self._store or dist.TCPStore(*spec.store_at, self.world_size, is_master=False, timeout=timeout)
        dist.init_process_group("nccl" if config.device.startswith("cuda") else "gloo", store=store,
                                rank=self.rank, world_size=self.world_size, timeout=timeout)
        self.gang = join(tuple(spec.rendezvous_at), self.rank, self.world_size, spec.secret, timeout=spec.timeout)
        tables = host_tables(spec.checkpoint) if self.reads_host_tables else []
        extra = {"host_tensors": map_node_tables(tables, config)} if tables else {}
        # a gang of one that holds every expert once, and never re-places them, runs its MoE layers as the
        # single-process engine does: sharded, each layer would pay a dispatch and a combine (copies within
        # the one rank), slot choice and EPLB counts: a tenth of a step at batch 1 on the tiny Qwen3-MoE
        whole = self.world_size == 1 and config.eplb_interval == 0 and all(
            row == sorted(row) == list(range(len(row))) for row in spec.phy2log)
        shard = None if whole else (ExpertParallel(spec.slots_per_rank, expert_ranks=range(*spec.expert_ranks)),
                                    torch.tensor(spec.phy2log))
        model = load_model(spec.checkpoint, dtype=config.dtype, device=config.device, weights=config.weights,
                           shard=shard, **extra)
        return model, config

    def _start(self) -> None:
        threading.Thread(target=self._loop, daemon=True, name=f"{self.role}-{self.rank}").start()

    def wake(self) -> None:
        """Resume stepping (new work somewhere in the gang); raises if this member's gang failed."""
        if self.error:
            raise RuntimeError(self.error)
        self._wake.set()

    def nudge(self) -> None:
        """Step again if asleep (a peer took in work); never raises, unlike `wake`."""
        self._wake.set()

    def _wake_others(self) -> None:
        """Make every other member step (call when taking in work): none may be left asleep while
        this one waits for it at the next host sync. Only after an idle sync: while the gang is busy
        every member steps anyway."""
        if self._gang_idle:
            for member in self._others:
                member.nudge.remote()

    def ping(self) -> MemberPing:
        """Liveness and where this member runs."""
        import ray

        return MemberPing(self.role, self.rank, os.getpid(), ray.get_runtime_context().get_node_labels(),
                          time.process_time(), self.error)

    def stats(self) -> dict:
        """Role, rank, this member's counters, and seconds per step phase (with RACKSERVE_PROFILE=1)."""
        return {"role": self.role, "rank": self.rank, **self._stats(), "phases": timing.totals()}

    def _stats(self) -> dict:
        raise NotImplementedError

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()

    def _step(self) -> bool:
        """One gang step; True while some member of the gang has work."""
        raise NotImplementedError

    def _loop(self) -> None:
        try:
            while not self._stop:
                self._gang_idle = not self._step()
                if self._gang_idle:  # no member had work: sleep until someone submits
                    self._wake.wait()
                    self._wake.clear()
        except Exception as e:  # a dead peer or transport error: fail the waiting callers clearly
            traceback.print_exc()  # the full story goes to this actor's log
            with self._lock:
                self.error = (f"{self.role} {self.rank} of {self.world_size}: the gang failed "
                              f"({type(e).__name__}: {e})")
                self._lock.notify_all()
        finally:
            if self.gang is not None:
                self.gang.close()
