"""`GangSupervisor`: the life of one instance's gang of rank actors: start, restart, shut down.

A gang is one *generation* of members, started together, joined into one process group and host
collective, each holding its share of the model. A failed gang cannot be mended (its process group
is broken), so it is replaced whole: the first caller to report generation g failed (`fail`) gets
it diagnosed, killed and started again as generation g+1 while the others wait; later reports of g
change nothing and get the same reason. A gang that fails to start is killed at once, so it holds
no actors, nor their resources (GPUs, placement-group bundles); the instance is then *down* (`down`
says why) until a later restart succeeds.

Placement: in a placement group, a gang starts only once the group holds every bundle. A group that
lost a node (its bundles there are label-pinned to that tray, so Ray re-places them only when a node
of that tray joins) is re-planned by the owner's `replace_placement` onto free GPUs, if it gave one;
otherwise, or if that finds no room, the start gives up after `TIMEOUTS.gang_place_s` with an `UnplacedError`
naming what it waits for, and the owner's watcher tries again. Members that do not all run within
`TIMEOUTS.gang_start_s` of their creation end the start the same way: a start never blocks without a bound.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rackserve.actors.dp_rank import DPRank
from rackserve.actors.expert_rank import ExpertRank
from rackserve.actors.gang_member import GangSpec
from rackserve.cluster.faults import InstanceError, UnplacedError, diagnose, member_name
from rackserve.collective import RendezvousServer
from rackserve.placement.ray_groups import lost_node
from rackserve.timeouts import TIMEOUTS

# (rank 0's TCP store, the rendezvous server's address, the gang's secret) -> what every member joins with
SpecMaker = Callable[[tuple[str, int], tuple[str, int], str], GangSpec]


class GangSupervisor:
    def __init__(self, label: str, dep: int, world: int, spec: SpecMaker, timeout: float,
                 actor_options: dict | None = None, placement_group: PlacementGroup | None = None,
                 on_restart: Callable[[], None] | None = None,
                 replace_placement: Callable[[], PlacementGroup] | None = None):
        """Start the gang of `world` members, DP ranks `0 … dep-1` then expert ranks, of the instance
        `label` names ("DEP2 instance 'decode0'", for errors); `spec` makes the `GangSpec` of each
        start; `timeout` (s): how long rank 0's TCP store waits for the others; `actor_options`: Ray options of every
        member; with a `placement_group` member i runs in bundle i; `on_restart`: called after a
        restart, under the lock (a restart caller returns after it); `replace_placement`: a new, placed
        group for the gang when its group lost a node (raises `UnplacedError` if there is no room)."""
        self.label, self.dep, self.world, self.timeout = label, dep, world, timeout
        self._spec, self._actor_options, self._placement_group = spec, dict(actor_options or {}), placement_group
        self._on_restart, self._replace_placement = on_restart, replace_placement
        self._lock = threading.RLock()  # the generation and its members; a restart holds it for seconds
        # one diagnosis per failed generation: taken by `fail` under `_lock` and by clients alone (never waits for it)
        self._diagnosing = threading.Lock()
        self._failures: dict[int, str] = {}  # gang generation -> why it failed
        self.generation = -1
        self.members: list = []
        self.stopped = False  # shut down: a failure found afterwards restarts nothing
        self.restarting = False  # a restart is under way
        self.down: str | None = None  # why the gang is not running (its last start failed), else None
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
        it, once however many threads or clients find it failed; returns the reason. A restart that
        fails raises an `InstanceError` saying so (the instance is then `down`)."""
        with self._lock:
            if generation == self.generation and not self.stopped:
                self.reason(generation, cause)
                self.restarting = True
                try:
                    self._kill()
                    self._start()
                    if self._on_restart is not None:
                        self._on_restart()
                except InstanceError:
                    raise
                except Exception as e:  # e.g. a member died while the gang met: said so to every caller alike
                    if self.down is None:  # started, but not wired to its peers: no use, start it again later
                        self._kill()
                        self.down = f"{self.label}: its gang did not start ({_first_line(e)})"
                    raise InstanceError(f"{self.label}: its gang did not start again ({_first_line(e)}); the next "
                                        "request, or the owner's watcher, starts it again") from e
                finally:
                    self.restarting = False
            if self.stopped:
                return f"{self.label} was shut down"
            return self._failures.get(generation, f"{self.label} restarted its gang")

    def reason(self, generation: int, cause: BaseException | str) -> str:
        """Why gang `generation` failed: the members at fault, diagnosed by the first caller while the
        gang is as it failed (before its restart kills it), else `cause`; the same for every later
        caller. Restarts nothing, so a client can end the lost requests before a restart that may be
        long (a model to load, a lost node to re-plan)."""
        with self._diagnosing:
            if generation not in self._failures:
                if generation != self.generation:  # replaced already: its members are gone
                    return f"{self.label} restarted its gang"
                if self.down is not None:  # its last start failed: nothing ran
                    self._failures[generation] = self.down
                else:
                    detail = diagnose(self.members, self.dep) or (
                        cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}")
                    self._failures[generation] = f"{self.label} failed: {detail}"
            return self._failures[generation]

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

    def placement_group(self) -> PlacementGroup | None:
        """The placement group the gang runs in (a new one once its old one was re-planned)."""
        return self._placement_group

    def _start(self) -> None:
        """Create the members where they are placed, join them into a gang, load the model on each,
        start their loops; on failure kill them and raise (`down` says why)."""
        self.generation += 1
        secret = secrets.token_hex(16)
        self._server = RendezvousServer(self.world, secret)
        try:
            for _ in range(2):  # the group lost a node while the members started: place them once more
                self._place()
                self.members = [self._actor(i).remote(i, self.world) for i in range(self.world)]
                if self._running():
                    break
                for member in self.members:
                    ray.kill(member)
            else:
                raise UnplacedError(f"{self.label}: its placement group lost a node twice while the gang started")
            store_at = ray.get(self.members[0].endpoint.remote(self.timeout))
            spec = self._spec(tuple(store_at), self._server.address, secret)
            ray.get([m.setup.remote(spec, self.members) for m in self.members])
        except BaseException as e:
            self._kill()  # a gang that did not start holds no actors (nor their resources) either
            self.down = (str(e) if isinstance(e, UnplacedError)
                         else f"{self.label}: its gang did not start ({_first_line(e)})")
            raise
        self.down = None

    def _place(self) -> None:
        """Return once the gang's placement group (if any) holds every bundle: a group that lost a node
        is replaced by the owner's re-plan when there is one; else wait up to `TIMEOUTS.gang_place_s`."""
        group = self._placement_group
        if group is None:
            return
        if self._replace_placement is not None and lost_node(group):
            self._placement_group = self._replace_placement()
        # the first start's group is new: it gets as long as the members get to start
        elif not group.wait(place_s := TIMEOUTS.gang_place_s if self.generation else TIMEOUTS.gang_start_s):
            raise UnplacedError(f"{self.label}: its placement group is not placed after {place_s:.0f} s (a node of "
                                "its trays is gone, or busy); it starts once a node with those labels and room joins")

    def _running(self) -> bool:
        """Whether every member's process runs (it answers a ping) within `TIMEOUTS.gang_start_s`: False as soon as the
        placement group loses a node meanwhile (members placed there never start)."""
        refs = [m.ping.remote() for m in self.members]
        deadline = time.monotonic() + TIMEOUTS.gang_start_s
        while True:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0.5)
            if len(ready) == len(refs):
                try:
                    ray.get(refs)
                    return True
                except ray.exceptions.RayActorError:  # died starting: with its node (placed before Ray knew)?
                    if self._lost():
                        return False
                    raise
            if self._lost():
                return False
            if time.monotonic() > deadline:
                late = [member_name(i, self.dep) for i, ref in enumerate(refs) if ref not in ready]
                raise UnplacedError(f"{self.label}: {', '.join(late)} did not start within "
                                    f"{TIMEOUTS.gang_start_s:.0f} s (no node with room for them?); see `ray status`")

    def _lost(self) -> bool:
        return self._placement_group is not None and lost_node(self._placement_group)

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


def _first_line(e: BaseException) -> str:
    """"Type: first line of the message": a remote error's message carries its whole traceback."""
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
