"""`GangSupervisor`: the life of one instance's gang of rank actors: start, restart, shut down.

A gang is one *generation* of members, started together, joined into one process group and host
collective, each holding its share of the model. A failed gang cannot be mended (its process group
is broken), so it is replaced whole: the first caller to report generation g failed (`fail`) gets
it diagnosed, killed and started again as generation g+1 while the others wait; later reports of g
change nothing and get the same reason. A gang that fails to start is killed at once, so it holds
no actors, nor their resources (GPUs, placement-group bundles).
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rackserve.actors.dp_rank import DPRank
from rackserve.actors.expert_rank import ExpertRank
from rackserve.actors.faults import diagnose
from rackserve.actors.gang_member import GangSpec
from rackserve.collective import RendezvousServer

# (rank 0's TCP store, the rendezvous server's address, the gang's secret) -> what every member joins with
SpecMaker = Callable[[tuple[str, int], tuple[str, int], str], GangSpec]


class GangSupervisor:
    def __init__(self, label: str, dep: int, world: int, spec: SpecMaker, timeout: float,
                 actor_options: dict | None = None, placement_group: PlacementGroup | None = None,
                 on_restart: Callable[[], None] | None = None):
        """Start the gang of `world` members, DP ranks `0 … dep-1` then expert ranks, of the instance
        `label` names ("DEP2 instance 'decode0'", for errors); `spec` makes the `GangSpec` of each
        start; `timeout` (s): how long rank 0's TCP store waits for the others; `actor_options`: Ray options of every
        member; with a `placement_group` member i runs in bundle i; `on_restart`: called after a
        restart, under the lock (a restart caller returns after it)."""
        self.label, self.dep, self.world, self.timeout = label, dep, world, timeout
        self._spec, self._actor_options, self._placement_group = spec, dict(actor_options or {}), placement_group
        self._on_restart = on_restart
        self._lock = threading.RLock()  # the generation and its members; a restart holds it for seconds
        self._failures: dict[int, str] = {}  # gang generation -> why it failed
        self.generation = -1
        self.members: list = []
        self.stopped = False  # shut down: a failure found afterwards restarts nothing
        self.restarting = False  # a restart is under way
        self._start()

    def current(self) -> tuple[int, list]:
        """(generation, member handles) of the current gang."""
        with self._lock:
            return self.generation, list(self.members)

    @property
    def failures(self) -> list[str]:
        """Why each gang failed so far, oldest first."""
        return list(self._failures.values())

    def fail(self, generation: int, cause: BaseException | str) -> str:
        """Record why gang `generation` failed (naming the members at fault, else `cause`) and restart
        it, once however many threads or clients find it failed; returns the reason."""
        with self._lock:
            if generation == self.generation and not self.stopped:
                detail = diagnose(self.members, self.dep) or (
                    cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}")
                self._failures[generation] = f"{self.label} failed: {detail}"
                self.restarting = True
                try:
                    self._kill()
                    self._start()
                    if self._on_restart is not None:
                        self._on_restart()
                finally:
                    self.restarting = False
            if self.stopped:
                return f"{self.label} was shut down"
            return self._failures.get(generation, f"{self.label} restarted its gang")

    def shutdown(self) -> int:
        """Stop every member (one that already died is skipped) and release them, after any restart
        in progress; the generation that was stopped."""
        with self._lock:
            self.stopped = True
            for member in self.members:
                try:
                    ray.get(member.shutdown.remote())
                except ray.exceptions.RayActorError:
                    pass
            self._kill()
            return self.generation

    def _start(self) -> None:
        """Create the members, join them into a gang, load the model on each, start their loops."""
        self.generation += 1
        secret = secrets.token_hex(16)
        self._server = RendezvousServer(self.world, secret)
        self.members = [self._actor(i).remote(i, self.world) for i in range(self.world)]
        try:
            store_at = ray.get(self.members[0].endpoint.remote(self.timeout))
            spec = self._spec(tuple(store_at), self._server.address, secret)
            ray.get([m.setup.remote(spec, self.members) for m in self.members])
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

    def _kill(self) -> None:
        for member in self.members:
            ray.kill(member)
        self._server.close()
